//! `BINX_BENCH_PIPELINE_DEPTH`: DATA requests an `ExchangeSource` of a
//! bench keeps in flight (1: one at a time, as before pipelined DATA);
//! unset, the default.

use binx_client::SourceConfig;

/// The source config a bench reads with.
pub(crate) fn source_config() -> SourceConfig {
    let default = SourceConfig::default();
    let pipeline_depth = std::env::var("BINX_BENCH_PIPELINE_DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(default.pipeline_depth);
    SourceConfig {
        pipeline_depth,
        ..default
    }
}
