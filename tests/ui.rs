//! Every compile-time error a user can meet, pinned with its message and span:
//! `ui-tests/{event,event_set,aggregate,unit_of_work}/*.rs`, each beside its `.stderr`.
//! `TRYBUILD=overwrite cargo test --test ui` rewrites the expectations after a deliberate
//! change; read the diff.

/// The compiler flags trybuild 1.0 gives the cases (its `rustflags.rs`, and
/// `--diagnostic-width=140` from its `cargo.rs`), as `CARGO_ENCODED_RUSTFLAGS` wants them:
/// separated by the unit separator, 0x1f (the Cargo book, "Environment variables").
const TRYBUILD_FLAGS: &str =
    "--cfg\x1ftrybuild\x1f--verbose\x1f-A\x1fdead_code\x1f--diagnostic-width=140";

#[test]
fn compile_errors() {
    // trybuild checks the cases' dependencies with its flags, then the cases with the same
    // flags and `--diagnostic-width=140`; cargo keys each crate's artifacts by its flags, so
    // every dependency (diesel, tokio, async-nats, ...) was checked twice: 3 min 45 s for
    // this test from a clean build directory on the project's two-core machine. trybuild
    // passes its flags as `--config build.rustflags`, which `CARGO_ENCODED_RUSTFLAGS`
    // overrides: set, both steps use the same flags and the dependencies are checked once
    // (2 min 20 s). It replaces any flags of the caller's (`RUSTFLAGS`) for the cases too,
    // as trybuild itself does but for `-C instrument-coverage`.
    // SAFETY: this binary runs this one test; no other thread reads the environment.
    unsafe { std::env::set_var("CARGO_ENCODED_RUSTFLAGS", TRYBUILD_FLAGS) };
    let cases = trybuild::TestCases::new();
    cases.compile_fail("ui-tests/*/*.rs");
}
