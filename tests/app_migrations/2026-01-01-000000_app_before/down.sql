DROP TABLE app_before;
