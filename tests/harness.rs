//! The test harness's own rules, where a mistake would make a test pass without running.

#[path = "support/libtest.rs"]
mod libtest;

fn selects(args: &[&str]) -> bool {
    let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
    libtest::selects("chaos", &args, &["--duration", "--seed"])
}

/// CI runs the suite a second time, against a current nats-server, with `-- --exact --skip
/// compile_errors`: the chaos run read `compile_errors` as a filter that did not match it
/// and printed "chaos run: filtered out", so that run never met the current server.
#[test]
fn a_skip_of_another_test_runs_the_chaos_run() {
    assert!(selects(&["--exact", "--skip", "compile_errors"]));
    assert!(selects(&["--skip", "compile_errors"]));
    assert!(selects(&["--skip=compile_errors"]));
    assert!(selects(&["--test-threads", "2", "--skip", "ui"]));
}

#[test]
fn filters_select_the_chaos_run_as_libtest_selects_a_test() {
    assert!(selects(&[]));
    assert!(selects(&["chaos"]));
    assert!(selects(&["cha"]));
    assert!(selects(&["other", "haos"]));
    assert!(!selects(&["other"]));
    assert!(selects(&["--exact", "chaos"]));
    assert!(!selects(&["--exact", "cha"]));
    assert!(selects(&["--nocapture", "--duration", "600", "chaos"]));
    // A value of an option is not a filter.
    assert!(selects(&["--duration", "600"]));
    assert!(selects(&[
        "--seed", "7", "--format", "terse", "--color", "never"
    ]));
}

#[test]
fn a_skip_that_names_the_chaos_run_skips_it() {
    assert!(!selects(&["--skip", "chaos"]));
    assert!(!selects(&["--skip", "ha"]));
    assert!(!selects(&["--skip=chaos"]));
    assert!(!selects(&["--skip", "x", "--skip", "chaos"]));
    assert!(selects(&["--exact", "--skip", "ha"]));
    assert!(!selects(&["--exact", "--skip", "chaos"]));
    assert!(!selects(&["chaos", "--skip", "chaos"]));
}

#[test]
fn the_chaos_run_is_not_an_ignored_test() {
    assert!(!selects(&["--ignored"]));
    assert!(!selects(&["--ignored", "chaos"]));
    assert!(selects(&["--include-ignored"]));
}
