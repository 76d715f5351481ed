//! Rebuilds the crate when a migration is added, changed or removed: `embed_migrations!`
//! reads the migration directories when the crate compiles, and Cargo reruns a compilation
//! only for the files it was told of (diesel_migrations' documentation of `embed_migrations!`,
//! "Automatic rebuilds").
fn main() {
    for directory in ["migrations", "migrations-mysql", "migrations-sqlite"] {
        println!("cargo:rerun-if-changed={directory}");
    }
}
