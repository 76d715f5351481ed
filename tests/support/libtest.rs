//! Which tests libtest's command line selects, for a test binary that has no libtest harness
//! (`harness = false` in `Cargo.toml`: the chaos run), so that `cargo test` and its
//! arguments treat it as one test of its name, as they treat every other: positional
//! filters, `--exact`, `--skip FILTER` (repeatable), `--ignored` and `--include-ignored`
//! (the rules of libtest's `filter_tests`, Rust's `library/test/src/lib.rs`, and its options,
//! `cargo test -- --help`).

/// libtest's options that take a value: what follows one is not a filter.
const LIBTEST_VALUED: [&str; 7] = [
    "--logfile",
    "--test-threads",
    "--skip",
    "--color",
    "--format",
    "-Z",
    "--shuffle-seed",
];

/// Whether the arguments `args` (the program's name left out) run the test `name`, which is
/// not an ignored one; `own_valued` are the binary's own options that take a value
/// (`--duration 600`), whose values are not filters either.
pub fn selects(name: &str, args: &[String], own_valued: &[&str]) -> bool {
    let mut filters: Vec<&str> = Vec::new();
    let mut skips: Vec<&str> = Vec::new();
    let (mut exact, mut ignored_only) = (false, false);
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        if let Some(skip) = arg.strip_prefix("--skip=") {
            skips.push(skip);
            continue;
        }
        match arg.as_str() {
            "--exact" => exact = true,
            "--ignored" => ignored_only = true,
            "--skip" => skips.extend(rest.next().map(String::as_str)),
            flag if LIBTEST_VALUED.contains(&flag) || own_valued.contains(&flag) => {
                rest.next();
            }
            flag if flag.starts_with('-') => {}
            filter => filters.push(filter),
        }
    }
    let matches = |pattern: &str| {
        if exact {
            name == pattern
        } else {
            name.contains(pattern)
        }
    };
    !ignored_only
        && (filters.is_empty() || filters.iter().any(|filter| matches(filter)))
        && !skips.iter().any(|skip| matches(skip))
}
