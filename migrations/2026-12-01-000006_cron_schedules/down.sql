DROP TABLE postbox.schedules;
