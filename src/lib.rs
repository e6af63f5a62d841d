//! The root package holds only the end-to-end tests (tests/) and the benches (benches/).
