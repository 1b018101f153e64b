CREATE TABLE app_after (id bigint PRIMARY KEY);
