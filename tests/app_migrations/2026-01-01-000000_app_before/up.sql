CREATE TABLE app_before (id bigint PRIMARY KEY);
