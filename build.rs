//! Rebuilds the crate when a migration is added: `embed_migrations!` reads `migrations/` at
//! compile time, and cargo does not otherwise notice a new directory there.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
