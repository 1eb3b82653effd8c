// sqlx's `migrate!` embeds the repository's migrations/ at compile time; rebuild when they change.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
