DROP TABLE postbox.pauses;
