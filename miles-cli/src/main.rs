//! The `miles` command.

fn main() {}
