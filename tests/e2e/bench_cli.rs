//! `binx bench` against a live binxd: one command that fills, reads over
//! BinX and HTTP, and cleans up; and the two-step form for other hosts.

use crate::common::{Daemon, binx, stderr, stdout};

/// `binx bench` against `daemon`, its HTTP exchange at `http` ("" skips
/// it), with the case options `rest`.
fn bench(daemon: &Daemon, http: &str, rest: &[&str]) -> std::process::Output {
    let mut args = vec!["bench", "--remote", &daemon.tcp, "--http", http];
    args.extend_from_slice(rest);
    binx(daemon, &args)
}

/// The data rows of the markdown table `binx bench` prints.
fn rows(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| chunk"))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

#[test]
fn bench_measures_binx_and_http_and_leaves_nothing_behind() {
    let daemon = Daemon::start(&[]);
    let out = bench(
        &daemon,
        &daemon.http,
        &[
            "--sizes",
            "1KiB,64KiB",
            "--parallel",
            "1,4",
            "--chunks",
            "16",
            "--time-per-case",
            "50ms",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let table = rows(&stdout(&out));
    let cases: Vec<(&str, &str, &str)> = table
        .iter()
        .map(|r| (r[0].as_str(), r[1].as_str(), r[2].as_str()))
        .collect();
    assert_eq!(
        cases,
        [
            ("1.0 KiB", "1", "16"),
            ("1.0 KiB", "4", "16"),
            ("64.0 KiB", "1", "16"),
            ("64.0 KiB", "4", "16")
        ]
    );
    for row in &table {
        let binx_mbs: f64 = row[3].parse().unwrap();
        let ratio: f64 = row[5].parse().unwrap();
        let iterations: u64 = row[6].parse().unwrap();
        assert!(binx_mbs >= 0.0 && ratio > 0.0 && iterations >= 3, "{row:?}");
    }
    // Every byte was read by both protocols (the bench checks the counts),
    // and the tasks are gone.
    let stats = daemon.stats();
    assert_eq!(stats["tasks"], 0, "{stats}");
    assert_eq!(stats["memory_used"], 0, "{stats}");
    assert!(stats["requests"]["DATA OK"].as_u64().unwrap() >= 4 * 3 * 16);
}

#[test]
fn bench_spreads_exchanges_over_the_connections_asked_for() {
    let daemon = Daemon::start(&[]);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Connections binxd accepted during one bench over `n` connections
    // (0: the client's default, one per two cores, at least 1, at most 8).
    let run = |n: &str| {
        let shown = match n {
            "0" => (cores / 2).clamp(1, 8).to_string(),
            n => n.to_string(),
        };
        let before = daemon.stats()["connections_total"].as_u64().unwrap();
        let out = bench(
            &daemon,
            "",
            &[
                "--sizes",
                "4KiB",
                "--parallel",
                "6",
                "--chunks",
                "8",
                "--time-per-case",
                "50ms",
                "--connections",
                n,
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        assert!(
            text.contains(&format!("BinX over {shown} connection(s)")),
            "{text}"
        );
        assert_eq!(rows(&text).len(), 1, "{text}");
        daemon.stats()["connections_total"].as_u64().unwrap() - before
    };
    let one = run("1");
    let three = run("3");
    // The Unix socket connections that fill are the same in both runs.
    assert_eq!(three - one, 2, "one run opened {one}, the other {three}");
    assert_eq!(daemon.stats()["tasks"], 0);
    let default = run("0");
    assert_eq!(default - one, (cores / 2).clamp(1, 8) as u64 - 1);
    let refused = bench(&daemon, "", &["--connections", "65"]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("--connections must be between 0 (the client's default) and 64")
    );
}

#[test]
fn bench_fill_only_then_read_elsewhere_by_prefix() {
    let daemon = Daemon::start(&[]);
    let plan = ["--sizes", "2KiB", "--parallel", "2", "--chunks", "8"];
    let mut args = vec!["bench", "--fill-only"];
    args.extend(plan);
    let out = binx(&daemon, &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let prefix = text
        .split("--prefix ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no prefix in {text}"))
        .to_string();
    assert_eq!(daemon.stats()["tasks"], 1);

    // The reader needs no socket of that daemon: TCP only, HTTP skipped.
    let mut args = vec![
        "bench",
        "--prefix",
        &prefix,
        "--remote",
        &daemon.tcp,
        "--http",
        "",
        "--uds",
        "/nonexistent/binx.sock",
        "--time-per-case",
        "50ms",
    ];
    args.extend(plan);
    let out = binx(&daemon, &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = rows(&stdout(&out));
    assert_eq!(table.len(), 1);
    assert_eq!((table[0][4].as_str(), table[0][5].as_str()), ("-", "-"));

    // A reader with another plan is told so instead of reporting nonsense.
    let out = binx(
        &daemon,
        &[
            "bench",
            "--prefix",
            &prefix,
            "--remote",
            &daemon.tcp,
            "--http",
            "",
            "--sizes",
            "2KiB",
            "--parallel",
            "2",
            "--chunks",
            "9",
        ],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("was it filled with the same plan"),
        "{}",
        stderr(&out)
    );
}
