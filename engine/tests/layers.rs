//! The layering rule of `docs/design/architecture.md`, checked against the
//! code: every `crate::…` path in `engine/src` names a module on a lower line
//! of the picture, and the files of `store/` form no circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The picture's lines, bottom first: each module's rank.
fn ranks(doc: &str) -> BTreeMap<String, usize> {
    let block = doc
        .split("```layers\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/design/architecture.md has a ```layers block");
    let lines: Vec<&str> = block.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut ranks = BTreeMap::new();
    for (rank, line) in lines.iter().rev().enumerate() {
        // Module names come first; two spaces or more start the description.
        let names = line.split("  ").next().unwrap_or_default();
        for name in names.split_whitespace() {
            assert!(
                ranks.insert(name.to_owned(), rank).is_none(),
                "{name} is placed twice in the picture"
            );
        }
    }
    ranks
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source tree") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file with its comments left out (doc links may point
/// anywhere; only code imports), lines kept in place.
fn code(text: &str) -> String {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The engine's wings: directories whose modules are placed one by one,
/// as `wing::module`.
const WINGS: [&str; 3] = ["rules", "net", "node"];

/// The unit a path starting at `s` names: its first segment, or
/// `wing::module` when the first is a wing.
fn unit_at(s: &str) -> String {
    let first = ident_at(s);
    if WINGS.contains(&first) {
        if let Some(rest) = s[first.len()..].strip_prefix("::") {
            let second = ident_at(rest);
            if !second.is_empty() {
                return format!("{first}::{second}");
            }
        }
    }
    first.to_owned()
}

/// The wing a unit belongs to, or the unit itself outside the wings.
fn wing_of(unit: &str) -> &str {
    unit.split("::").next().unwrap_or(unit)
}

/// A circle in `edges`, if there is one, as the path that closes it.
fn find_circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == n) {
            let mut circle = path[at..].to_vec();
            circle.push(n.to_owned());
            return Some(circle);
        }
        if !done.insert(n.to_owned()) {
            return None;
        }
        path.push(n.to_owned());
        for next in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|n| visit(n, edges, &mut Vec::new(), &mut done))
}

/// The unit (first path segment, or `wing::module`) after each `prefix`
/// in `text`, with its line,
/// including each member of a grouped `prefix{a::X, b}` (over any number
/// of lines, as rustfmt wraps a long group).
fn targets(text: &str, prefix: &str) -> Vec<(usize, String)> {
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (at, _) in text.match_indices(prefix) {
        let rest = &text[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && !c.is_whitespace() => {
                        let at = at + prefix.len() + 1 + i;
                        out.push((line_of(at), unit_at(&group[i..])));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push((line_of(at), unit_at(rest)));
        }
    }
    out
}

/// What `pub use module::{A, B};` lines of `file` re-export: name -> module.
fn reexports(file: &Path) -> BTreeMap<String, String> {
    let text = code(&std::fs::read_to_string(file).expect("a readable source file"));
    let mut out = BTreeMap::new();
    for statement in text.split(';') {
        let statement = statement.trim();
        let Some(path) = statement.strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = path.rsplit_once("::") else {
            continue;
        };
        let module = unit_at(module.trim());
        for name in names.trim_matches(|c| c == '{' || c == '}').split(',') {
            let name = name.rsplit("::").next().unwrap_or_default().trim();
            if !name.is_empty() {
                out.insert(name.to_owned(), module.clone());
            }
        }
    }
    out
}

struct Import {
    file: String,
    line: usize,
    from: String,
    to: String,
}

/// Every import of `prefix…` in the files under `src`, each named by the
/// unit it comes from and the unit it names (a re-exported item counts as
/// its module: `crate::Store` is `store`).
fn imports(
    src: &Path,
    prefix: &str,
    unit: impl Fn(&Path) -> String,
    reexported: &BTreeMap<String, String>,
) -> Vec<Import> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text = code(&std::fs::read_to_string(&file).expect("a readable source file"));
        let from = unit(&file);
        for (line, to) in targets(&text, prefix) {
            let to = reexported.get(&to).cloned().unwrap_or(to);
            if !to.is_empty() && to != from {
                out.push(Import {
                    file: file.strip_prefix(src).unwrap().display().to_string(),
                    line,
                    from: from.clone(),
                    to,
                });
            }
        }
    }
    out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_module_imports_a_module_above_it() {
    let doc_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/design/architecture.md");
    let ranks = ranks(&std::fs::read_to_string(doc_path).expect("the architecture document"));
    let src = src();
    // A file's unit: its top-level module, or `wing::module` inside a
    // wing (a wing's own `mod.rs` only declares its modules: `lib`).
    let top = |file: &Path| {
        let rel = file.strip_prefix(&src).unwrap();
        let parts: Vec<String> = rel
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_owned()
            })
            .collect();
        match parts.as_slice() {
            [wing, module, ..] if WINGS.contains(&wing.as_str()) => match module.as_str() {
                "mod" => "lib".to_owned(),
                m => format!("{wing}::{m}"),
            },
            [first, ..] => first.clone(),
            [] => unreachable!("a file has a path"),
        }
    };
    let mut modules = BTreeSet::new();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for f in &files {
        let m = top(f);
        if m != "lib" {
            modules.insert(m);
        }
    }
    let unplaced: Vec<&String> = modules.iter().filter(|m| !ranks.contains_key(*m)).collect();
    assert!(
        unplaced.is_empty(),
        "modules the picture in docs/design/architecture.md does not place: {unplaced:?}"
    );
    let mut wrong = Vec::new();
    let reexported = reexports(&src.join("lib.rs"));
    assert!(
        reexported.contains_key("Store"),
        "the scan reads lib.rs's re-exports"
    );
    for i in imports(&src, "crate::", top, &reexported) {
        if i.from == "lib" || !modules.contains(&i.to) {
            continue;
        }
        if ranks[&i.to] >= ranks[&i.from] {
            wrong.push(format!(
                "{}:{}: {} imports {}, which is not below it",
                i.file, i.line, i.from, i.to
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
    assert!(
        WINGS
            .iter()
            .all(|w| modules.iter().any(|m| wing_of(m) == *w && m.contains("::"))),
        "the scan found every wing's modules"
    );
}

#[test]
fn the_wings_import_each_other_in_one_direction() {
    // Rules, net and node, with every other top-level module as its own
    // unit: no circle among them, so a wing can be read (and moved) whole.
    let src = src();
    let unit = |file: &Path| {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        first.trim_end_matches(".rs").to_owned()
    };
    let reexported = reexports(&src.join("lib.rs"));
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for i in imports(&src, "crate::", unit, &reexported) {
        let to = wing_of(&i.to).to_owned();
        if i.from != "lib" && to != i.from {
            edges.entry(i.from).or_default().insert(to);
        }
    }
    for wing in WINGS {
        assert!(edges.contains_key(wing), "the scan found {wing}'s imports");
    }
    let circle = find_circle(&edges);
    assert!(
        circle.is_none(),
        "wings import in a circle: {:?}",
        circle.unwrap()
    );
}

#[test]
fn the_files_of_the_store_form_no_circle() {
    let store = src().join("store");
    let name = |file: &Path| file.file_stem().unwrap().to_string_lossy().into_owned();
    let mut files = Vec::new();
    rust_files(&store, &mut files);
    let siblings: BTreeSet<String> = files
        .iter()
        .map(|f| name(f))
        .filter(|n| n != "mod")
        .collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let reexported = reexports(&store.join("mod.rs"));
    assert!(
        reexported.contains_key("Fence"),
        "the scan reads mod.rs's re-exports"
    );
    for i in imports(&store, "super::", name, &reexported) {
        // A file may use what `mod.rs` declares; among siblings, no circle.
        if i.from != "mod" && siblings.contains(&i.to) {
            edges.entry(i.from).or_default().insert(i.to);
        }
    }
    assert!(
        !edges.is_empty(),
        "the scan found no import between store files at all"
    );
    let circle = find_circle(&edges);
    assert!(
        circle.is_none(),
        "store files import in a circle: {:?}",
        circle.unwrap()
    );
}

#[test]
fn the_scan_reads_grouped_and_nested_paths() {
    let names = |text: &str, prefix: &str| -> Vec<String> {
        targets(text, prefix).into_iter().map(|(_, n)| n).collect()
    };
    assert_eq!(
        names("use crate::{a::X, b, c::{d, e}};", "crate::"),
        ["a", "b", "c"]
    );
    assert_eq!(
        names("let x = crate::store::Store::new();", "crate::"),
        ["store"]
    );
    assert_eq!(
        names(
            "use crate::{rules::verdict::X, net::outbound, node};",
            "crate::"
        ),
        ["rules::verdict", "net::outbound", "node"]
    );
    assert_eq!(
        names("use super::rows::{lock_in_order, IdRow};", "super::"),
        ["rows"]
    );
    // A group rustfmt wrapped over lines, and the line of each member.
    let wrapped = "use crate::{\n    a::X,\n    b::{Y, Z},\n};";
    assert_eq!(
        targets(wrapped, "crate::"),
        [(2, "a".to_owned()), (3, "b".to_owned())]
    );
    assert_eq!(
        code("let u = 1; // crate::hidden\nuse crate::shown;"),
        "let u = 1; \nuse crate::shown;"
    );
    let doc = "```layers\ntop  the top\nmid other\nbottom\n```\n";
    let r = ranks(doc);
    assert!(r["top"] > r["mid"] && r["mid"] == r["other"] && r["other"] > r["bottom"]);
}
