// @generated automatically by Diesel CLI.

pub mod postbox {
    pub mod sql_types {
        #[derive(diesel::sql_types::SqlType)]
        #[diesel(postgres_type(name = "message_state", schema = "postbox"))]
        pub struct MessageState;

        #[derive(diesel::sql_types::SqlType)]
        #[diesel(postgres_type(name = "xid8", schema = "pg_catalog"))]
        pub struct Xid8;
    }

    diesel::table! {
        postbox.dead_letters (id) {
            id -> Int8,
            topic -> Text,
            key -> Nullable<Text>,
            ordered -> Bool,
            payload -> Jsonb,
            headers -> Jsonb,
            priority -> Int2,
            attempts -> Int4,
            max_attempts -> Int4,
            created_at -> Timestamptz,
            dedup_key -> Nullable<Text>,
            first_error -> Nullable<Text>,
            last_error -> Nullable<Text>,
            reason -> Text,
            dead_at -> Timestamptz,
            stream_id -> Nullable<Text>,
        }
    }

    diesel::table! {
        use diesel::sql_types::*;
        use super::sql_types::Xid8;

        postbox.intake (xid, id) {
            id -> Int8,
            xid -> Xid8,
            topic -> Text,
            key -> Nullable<Text>,
            payload -> Jsonb,
            headers -> Jsonb,
            priority -> Int2,
            run_at -> Timestamptz,
            max_attempts -> Int4,
            created_at -> Timestamptz,
        }
    }

    diesel::table! {
        use diesel::sql_types::*;
        use super::sql_types::MessageState;
        use super::sql_types::Xid8;

        postbox.messages (id) {
            id -> Int8,
            topic -> Text,
            key -> Nullable<Text>,
            ordered -> Bool,
            payload -> Jsonb,
            headers -> Jsonb,
            priority -> Int2,
            run_at -> Timestamptz,
            attempts -> Int4,
            max_attempts -> Int4,
            locked_until -> Nullable<Timestamptz>,
            lease_token -> Nullable<Int8>,
            locked_by -> Nullable<Text>,
            first_error -> Nullable<Text>,
            last_error -> Nullable<Text>,
            created_at -> Timestamptz,
            dedup_key -> Nullable<Text>,
            state -> MessageState,
            cancelled -> Bool,
            ready_xid -> Xid8,
            snoozes -> Int4,
        }
    }

    diesel::allow_tables_to_appear_in_same_query!(dead_letters, intake, messages,);
}
