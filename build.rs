//! Rebuilds the crate when a migration is added or edited: `embed_migrations!` reads
//! `migrations/` at compile time, and cargo does not otherwise notice a new directory there. The
//! digest of what it embeds (`BUILT_MIGRATIONS_DIGEST`) names the tests' template databases, so
//! a template is always built from the migrations the binary carries, not from the files as they
//! are when the tests run.
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("migrations/") {
        let p = e.expect("migrations/").path();
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    // The manifest's directory as cargo gives it to this run (not as it was when the script was
    // compiled: a compiled build script is reused by another checkout sharing the target dir).
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"))
        .join("migrations");
    let mut all = Vec::new();
    files(&root, &mut all);
    all.sort();
    // FNV-1a over each file's path (from migrations/) and contents: stable across toolchains.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for f in all {
        let name = f
            .strip_prefix(&root)
            .unwrap_or(&f)
            .to_string_lossy()
            .into_owned();
        let body = std::fs::read(&f).expect("a migration file");
        for b in name.bytes().chain([0]).chain(body).chain([0]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=BUILT_MIGRATIONS_DIGEST={h:016x}");
}
