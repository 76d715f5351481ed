//! Every compile-time error a user can meet, pinned with its message and span:
//! `ui-tests/{event,event_set,aggregate,unit_of_work}/*.rs`, each beside its `.stderr`.
//! `TRYBUILD=overwrite cargo test --test ui` rewrites the expectations after a deliberate
//! change; read the diff.

#[test]
fn compile_errors() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("ui-tests/*/*.rs");
}
