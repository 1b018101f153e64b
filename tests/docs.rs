//! The documentation cannot drift from the code: the configuration reference names every key the
//! relay accepts (asked of the relay itself), with the defaults it prints and every environment
//! variable it reads; the command-line reference names every command; the roles page shows the
//! SQL `postbox grant --sql` prints; every relative link of the README and the book leads to a file
//! (and a heading) that exists; the README stays short.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::hermetic;

const BIN: &str = env!("CARGO_BIN_EXE_postbox");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn postbox(args: &[&str]) -> (bool, String, String) {
    let out = hermetic(BIN).args(args).output().expect("run postbox");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The keys the configuration accepts in `section` (`""` for the top level), as the relay's own
/// parser lists them when it meets a key it does not know.
fn accepted_keys(section: &str) -> Vec<String> {
    let file = std::env::temp_dir().join(format!(
        "postbox-docs-{}-{}.toml",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::write(&file, format!("{section}\n__probe = 1\n")).unwrap();
    let (ok, _, err) = postbox(&["--config", file.to_str().unwrap(), "config", "check"]);
    let _ = std::fs::remove_file(&file);
    assert!(!ok, "an unknown key was accepted in {section:?}");
    let expected = err
        .split("expected ")
        .nth(1)
        .unwrap_or_else(|| panic!("{section}: no list of keys in {err}"));
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The first cell of each row of the reference's table: `relay.lease`, `routes[].format`.
fn documented_keys(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_configuration_reference_names_every_key_with_its_default_and_variable() {
    let page = read("docs/src/reference/configuration.md");
    let documented = documented_keys(&page);
    let sections = [
        ("", ""),
        ("[relay]", "relay."),
        ("[metrics]", "metrics."),
        ("[sinks.kafka]", "sinks.kafka."),
        ("[retention]", "retention."),
        ("[[routes]]", "routes[]."),
        ("[[schedules]]", "schedules[]."),
        ("[[limits]]", "limits[]."),
        ("[stream]", "stream."),
        ("[ui]", "ui."),
    ];
    let tables: BTreeSet<&str> = [
        "relay",
        "metrics",
        "sinks",
        "retention",
        "routes",
        "schedules",
        "limits",
        "stream",
        "ui",
    ]
    .into_iter()
    .collect();
    let mut accepted = BTreeSet::new();
    for (section, prefix) in sections {
        for key in accepted_keys(section) {
            if prefix.is_empty() && tables.contains(key.as_str()) {
                continue;
            }
            accepted.insert(format!("{prefix}{key}"));
        }
    }
    // `[sinks]` holds only `kafka`, a table.
    assert_eq!(accepted_keys("[sinks]"), vec!["kafka".to_owned()]);
    let missing: Vec<_> = accepted.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&accepted).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/src/reference/configuration.md: keys the relay accepts but the page does not name: \
         {missing:?}; keys the page names but the relay refuses: {unknown:?}"
    );

    // Every default the relay prints for an empty configuration is the page's.
    let (ok, printed, err) = postbox(&["config", "check"]);
    assert!(ok, "{err}");
    let mut section = Some(String::new());
    for line in printed.lines() {
        if line.starts_with("[[") {
            section = None; // the default route: not a default of a key
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = Some(format!("{s}."));
            continue;
        }
        let (Some(section), Some((key, value))) = (&section, line.split_once(" = ")) else {
            continue;
        };
        let key = format!("{section}{key}");
        let row = page
            .lines()
            .find(|l| l.starts_with(&format!("| `{key}` |")))
            .unwrap_or_else(|| panic!("{key} is printed by config check but not in the page"));
        let default = row.split('|').nth(2).unwrap();
        assert!(
            default.contains(value) || default.contains(value.trim_matches('"')),
            "{key}: the relay's default is {value}, the page says {default}"
        );
    }

    // Every environment variable the relay reads is named.
    let mut sources = String::new();
    for dir in ["src/config", "src/relay", "src/store", "src/stream"] {
        for entry in std::fs::read_dir(Path::new(ROOT).join(dir)).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "rs") {
                sources.push_str(&std::fs::read_to_string(p).unwrap());
            }
        }
    }
    sources.push_str(&read("src/main.rs"));
    let mut variables = BTreeSet::new();
    for (i, _) in sources.match_indices('"') {
        let rest = &sources[i + 1..];
        let len = rest
            .find(|c: char| !(c.is_ascii_uppercase() || c == '_'))
            .unwrap_or(rest.len());
        let name = rest[..len].trim_end_matches('_');
        let known = name.starts_with("POSTBOX_")
            || name.starts_with("PG")
            || name == "HOSTNAME"
            || name == "DATABASE_URL";
        if rest[len..].starts_with('"')
            && known
            && name.len() > 3
            && !name.starts_with("POSTBOX_TEST")
        {
            variables.insert(name.to_owned());
        }
    }
    assert!(variables.contains("POSTBOX_LEASE"), "{variables:?}");
    let unnamed: Vec<_> = variables
        .iter()
        .filter(|v| !page.contains(v.as_str()))
        .collect();
    assert!(
        unnamed.is_empty(),
        "variables the relay reads that the page does not name: {unnamed:?}"
    );
}

#[test]
fn the_command_line_reference_names_every_command() {
    let (ok, help, err) = postbox(&["--help"]);
    assert!(ok, "{err}");
    let page = read("docs/src/reference/cli.md");
    let commands: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.contains(&"grant"), "{help}");
    for c in commands {
        assert!(
            page.contains(&format!("postbox {c}")),
            "docs/src/reference/cli.md does not name `postbox {c}`"
        );
    }
}

#[test]
fn the_roles_page_shows_the_sql_grant_runs() {
    let page = read("docs/src/operations/roles.md");
    let marker = "<!-- generated: postbox grant --sql --writer app_writer --relay app_relay --operator app_operator";
    let after = page
        .split(marker)
        .nth(1)
        .expect("the roles page has the generated block");
    let block = after
        .split("```sql\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap();
    let (ok, printed, err) = postbox(&[
        "grant",
        "--sql",
        "--writer",
        "app_writer",
        "--relay",
        "app_relay",
        "--operator",
        "app_operator",
    ]);
    assert!(ok, "{err}");
    assert_eq!(
        block, printed,
        "docs/src/operations/roles.md: paste the output of `postbox grant --sql --writer app_writer --relay app_relay --operator app_operator`"
    );
}

/// GitHub's and mdBook's anchor of a heading: lower case, spaces to dashes, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        if !fenced && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            markdown_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "md") {
            out.push(p);
        }
    }
}

#[test]
fn every_relative_link_of_the_readme_and_the_book_leads_somewhere() {
    let mut files = vec![
        Path::new(ROOT).join("README.md"),
        Path::new(ROOT).join("helm/postbox/README.md"),
    ];
    markdown_files(&Path::new(ROOT).join("docs/src"), &mut files);
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let mut fenced = false;
        for line in text.lines() {
            if line.starts_with("```") {
                fenced = !fenced;
            }
            if fenced {
                continue;
            }
            for link in line.split("](").skip(1) {
                let Some(target) = link.split(')').next() else {
                    continue;
                };
                if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                    continue;
                }
                let (path, fragment) = target.split_once('#').unwrap_or((target, ""));
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().unwrap().join(path)
                };
                if !resolved.exists() {
                    broken.push(format!("{}: {target} (no such file)", file.display()));
                    continue;
                }
                if !fragment.is_empty() && resolved.extension().is_some_and(|e| e == "md") {
                    let headings = anchors(&std::fs::read_to_string(&resolved).unwrap());
                    if !headings.contains(fragment) {
                        broken.push(format!("{}: {target} (no such heading)", file.display()));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));

    // Every page is in the book's table of contents.
    let summary = read("docs/src/SUMMARY.md");
    for file in files
        .iter()
        .filter(|f| f.starts_with(Path::new(ROOT).join("docs/src")))
    {
        let rel = file.strip_prefix(Path::new(ROOT).join("docs/src")).unwrap();
        if rel != Path::new("SUMMARY.md") {
            assert!(
                summary.contains(&format!("]({})", rel.display())),
                "docs/src/SUMMARY.md does not list {}",
                rel.display()
            );
        }
    }
}

#[test]
fn the_readme_stays_short() {
    let lines = read("README.md").lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines: move the detail into the book (docs/src)"
    );
}
