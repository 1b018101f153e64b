//! Migrations are append-only: users' databases have run every migration that landed, and diesel
//! knows them by version. `tests/migrations.sha256` lists every file of every migration with its
//! checksum (`sha256sum` format, sorted by path); a changed, renamed or removed migration fails
//! here, and a new one must be appended to the list (with a version after every listed one).
//!
//! To append a new migration: `cd migrations && sha256sum <dir>/* | sed 's#  #  ./#'` and add
//! its lines at the end of the list.

use std::collections::BTreeMap;
use std::path::Path;

use sha2::{Digest, Sha256};

const LIST: &str = include_str!("migrations.sha256");

fn listed() -> BTreeMap<String, String> {
    LIST.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (sum, path) = l
                .split_once("  ./")
                .unwrap_or_else(|| panic!("not a sha256sum line: {l:?}"));
            (path.to_owned(), sum.to_owned())
        })
        .collect()
}

fn on_disk() -> BTreeMap<String, Vec<u8>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files = BTreeMap::new();
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap();
        if !dir.file_type().unwrap().is_dir() {
            continue;
        }
        for f in std::fs::read_dir(dir.path()).unwrap() {
            let f = f.unwrap();
            let name = format!(
                "{}/{}",
                dir.file_name().to_string_lossy(),
                f.file_name().to_string_lossy()
            );
            files.insert(name, std::fs::read(f.path()).unwrap());
        }
    }
    files
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_listed_migration_is_unchanged_and_every_new_one_comes_after_them() {
    let listed = listed();
    let disk = on_disk();
    for (path, sum) in &listed {
        let bytes = disk.get(path).unwrap_or_else(|| {
            panic!("{path}: a landed migration file is gone (renamed or removed)")
        });
        assert_eq!(
            &hex(&Sha256::digest(bytes)),
            sum,
            "{path}: a landed migration was changed; add a new migration instead"
        );
    }
    let newest_listed = listed
        .keys()
        .map(|p| p.split('/').next().unwrap())
        .max()
        .expect("the list is not empty");
    let unlisted: Vec<&String> = disk.keys().filter(|p| !listed.contains_key(*p)).collect();
    for path in &unlisted {
        let dir = path.split('/').next().unwrap();
        assert!(
            dir > newest_listed,
            "{path}: not in tests/migrations.sha256, and not newer than {newest_listed}: a new \
             migration goes after every landed one"
        );
    }
    assert!(
        unlisted.is_empty(),
        "new migration files {unlisted:?}: append their checksums to tests/migrations.sha256"
    );
}

#[test]
fn the_list_is_in_sha256sum_format_and_in_order() {
    let lines: Vec<&str> = LIST.lines().collect();
    let mut sorted = lines.clone();
    sorted.sort_by_key(|l| l.split_once("  ").map(|(_, p)| p.to_owned()));
    assert_eq!(lines, sorted, "sorted by path, as the comment says");
    for l in lines {
        let (sum, _) = l.split_once("  ./").expect("sha256sum format");
        assert_eq!(sum.len(), 64, "{l}");
    }
}
