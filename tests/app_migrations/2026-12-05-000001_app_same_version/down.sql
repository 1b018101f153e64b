DROP TABLE app_same_version;
