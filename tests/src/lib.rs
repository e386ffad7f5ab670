//! Workspace integration tests of miles live in `tests/tests/`, one file per backend and one for
//! the colocated loop; this library holds nothing.
