DROP TABLE app_after;
