CREATE TABLE app_same_version (id bigint PRIMARY KEY);
