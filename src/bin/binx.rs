//! binx, the command line (the code is in binx-cli; it does not link the server).

#![forbid(unsafe_code)]

fn main() {
    binx_cli::main()
}
