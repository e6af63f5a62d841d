//! The deterministic simulation (see `sim/mod.rs`): `cargo test` runs
//! 20,000 seeds (about 30 s; 3,000 did not reach a consumer reading an
//! abandoned buffer, which seed 13,287 does); a failing seed is replayed
//! with its schedule printed.
//!
//! Long run: `SIM_SEEDS=1000000 cargo test --release -p binx-core --test
//! simulation -- --ignored --nocapture many_seeds` prints seeds per second.
//! One seed: `SIM_SEED=1234 cargo test -p binx-core --test simulation --
//! --nocapture one_seed`.

mod sim;

use std::time::Instant;

use sim::{Summary, World};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Runs seeds `first..first + count`; panics with the schedule of the first
/// one that breaks an invariant.
fn run_seeds(first: u64, count: u64) -> (Summary, f64) {
    let start = Instant::now();
    let mut total = Summary::default();
    for seed in first..first + count {
        match World::new(seed, false).run() {
            Ok(summary) => total.add(&summary),
            Err((violation, _)) => {
                // Replay with the trace on: the same seed, the same schedule.
                let replay = World::new(seed, true);
                let params = World::describe(replay.params());
                let (again, trace) = match replay.run() {
                    Err((v, trace)) => (v, trace.unwrap_or_default()),
                    Ok(_) => panic!(
                        "seed {seed} failed once and passed on replay: the simulation is not deterministic ({})",
                        violation.what
                    ),
                };
                assert_eq!(
                    again.what, violation.what,
                    "seed {seed} replays differently"
                );
                let tail: Vec<&String> = trace.iter().rev().take(60).collect();
                let tail: Vec<&String> = tail.into_iter().rev().collect();
                panic!(
                    "seed {seed} broke an invariant at {:.3}s: {}\nparams: {params}\nlast events:\n{}\nreplay: SIM_SEED={seed} cargo test -p binx-core --test simulation -- --nocapture one_seed",
                    violation.at.as_secs_f64(),
                    violation.what,
                    tail.iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join("\n")
                );
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{count} seeds from {first}: {} steps in {secs:.1}s, {:.0} seeds/s\n{total:?}",
        total.steps,
        count as f64 / secs
    );
    (total, secs)
}

#[test]
fn a_few_thousand_seeds_keep_every_invariant() {
    let count = env_u64("SIM_SEEDS").unwrap_or(20_000);
    let (total, _) = run_seeds(env_u64("SIM_FIRST").unwrap_or(0), count);
    // The schedules reach what they are for: buffers read to the end, from
    // storage after failover too, abandoned, aborted, spilled.
    assert!(total.complete > count, "{total:?}");
    for (what, n) in [
        ("failover replies", total.failover_replies),
        ("abandoned buffers", total.abandoned),
        ("aborted tasks", total.aborted),
        ("spilled pages", total.pages_spilled),
        ("BUSY replies", total.busy),
        ("consumers whose pod crashed", total.dead),
        ("consumers that stopped early", total.stopped),
        (
            "producer connections closed while requests waited",
            total.closes,
        ),
        (
            "connections closed with an ENQUEUE waiting ahead of a NO_MORE_PAGES",
            total.cut_pipelines,
        ),
        ("DATA pipelined behind another", total.pipelined_data),
        (
            "replies dropped by a pipelining consumer",
            total.dropped_replies,
        ),
    ] {
        assert!(n > 0, "no {what} in {count} seeds: {total:?}");
    }
}

/// Seeds the long runs found failing, each replayed on every `cargo test`
/// (they broke exactness before the fix named beside them).
const FOUND_BY_LONG_RUNS: [(u64, &str); 2] = [
    (
        1_192_508,
        "a failover reply whose committed objects are gone is TIMEOUT, not SERVER_ERROR",
    ),
    (
        1_500_352,
        "a proxy consumer's DELETE of a lost BROADCAST buffer keeps the shared segments the live producer still serves",
    ),
];

#[test]
fn seeds_found_by_long_runs_keep_every_invariant() {
    for (seed, fix) in FOUND_BY_LONG_RUNS {
        // As found (consumers did not pipeline then), and as drawn now.
        for (world, how) in [
            (World::unpipelined(seed), "unpipelined"),
            (World::new(seed, false), "as drawn"),
        ] {
            if let Err((violation, _)) = world.run() {
                panic!(
                    "seed {seed} ({fix}, {how}) broke an invariant at {:.3}s: {}",
                    violation.at.as_secs_f64(),
                    violation.what
                );
            }
        }
    }
}

#[test]
fn one_seed() {
    let Some(seed) = env_u64("SIM_SEED") else {
        return;
    };
    let world = World::new(seed, true);
    eprintln!("params: {}", World::describe(world.params()));
    match world.run() {
        Ok(summary) => eprintln!("seed {seed}: every invariant held: {summary:?}"),
        Err((v, trace)) => {
            for line in trace.unwrap_or_default() {
                eprintln!("{line}");
            }
            panic!("seed {seed} at {:.3}s: {}", v.at.as_secs_f64(), v.what);
        }
    }
}

#[test]
#[ignore = "long run: SIM_SEEDS=1000000 cargo test --release -p binx-core --test simulation -- --ignored --nocapture many_seeds"]
fn many_seeds() {
    let count = env_u64("SIM_SEEDS").unwrap_or(1_000_000);
    let first = env_u64("SIM_FIRST").unwrap_or(1_000_000);
    let (total, secs) = run_seeds(first, count);
    println!(
        "simulation: {count} seeds, {} steps, {secs:.1}s, {:.0} seeds/s, 0 violations\n{total:?}",
        total.steps,
        count as f64 / secs
    );
}
