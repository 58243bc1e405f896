//! `socket`: task adds over the control socket — one client pipelining a window of requests,
//! and one at a time — against the same adds made in-process through the library (the same
//! store, the same group commit): the ratio is what the protocol layer costs.

use std::path::Path;
use std::time::Instant;

use runwarden::Supervisor;
use runwarden::board::NewTask;
use runwarden::config::Config;
use runwarden::control::client::Client;

use crate::Opts;
use crate::util::{Summary, add_pipelined};

const TARGET: f64 = 20_000.0;
/// Requests in flight on the pipelining connection.
const WINDOW: usize = 512;

/// Runs the scenario and appends its lines to `summary`.
pub fn run(opts: &Opts, dir: &Path, summary: &mut Summary) -> Result<(), String> {
    let n = opts.adds;
    let mut config = Config::with_data_dir(dir.join("socket"));
    config.supervisor.synchronous = if opts.sync_full {
        runwarden::config::Synchronous::Full
    } else {
        runwarden::config::Synchronous::Normal
    };
    // No assignee: the added tasks stay ready, so only the adds are measured.
    let sup = Supervisor::start(config.clone()).map_err(|e| e.to_string())?;
    let socket = config.socket_path();
    let task = |i: usize| NewTask::titled(format!("bench task {i}"));

    let mut pipelined = Vec::new();
    let mut direct = Vec::new();
    let mut single = Vec::new();
    for round in 0..opts.rounds {
        // Pipelined over the socket: keep WINDOW requests in flight.
        let mut client = Client::connect(&socket).map_err(|e| e.to_string())?;
        client.hello().map_err(|e| e.to_string())?;
        let start = Instant::now();
        add_pipelined(&mut client, n, WINDOW, task)?;
        let rate = n as f64 / start.elapsed().as_secs_f64();
        println!("round {round}: socket pipelined  {rate:>8.0} adds/s ({n} adds, window {WINDOW})");
        pipelined.push(rate);

        // Baseline: the same adds in-process, WINDOW at a time through the store.
        let store = sup.services().store.clone();
        let start = Instant::now();
        futures::executor::block_on(async {
            use futures::stream::{self, StreamExt};
            stream::iter(0..n)
                .map(|i| {
                    let store = store.clone();
                    let t = task(i);
                    async move { store.with_tx(move |tx, now| tx.create_task(&t, now)).await }
                })
                .buffer_unordered(WINDOW)
                .for_each(|r| async move {
                    r.expect("in-process add");
                })
                .await;
        });
        let rate = n as f64 / start.elapsed().as_secs_f64();
        println!("round {round}: in-process        {rate:>8.0} adds/s");
        direct.push(rate);

        // One at a time over the socket: each add waits for its durable reply.
        let m = opts.single_adds;
        let mut client = Client::connect(&socket).map_err(|e| e.to_string())?;
        client.hello().map_err(|e| e.to_string())?;
        let start = Instant::now();
        for i in 0..m {
            client.add_task(&task(i)).map_err(|e| e.to_string())?;
        }
        let rate = m as f64 / start.elapsed().as_secs_f64();
        println!("round {round}: socket one-by-one {rate:>8.0} adds/s ({m} adds)");
        single.push(rate);
    }
    sup.shutdown();

    let (p, d, s) = (
        crate::util::median(&pipelined),
        crate::util::median(&direct),
        crate::util::median(&single),
    );
    let verdict = summary.verdict(p >= TARGET);
    summary.line(format!(
        "socket: N={n} window={WINDOW} sync={} pipelined_median={p:.0}/s (target>={TARGET:.0}) {verdict} \
         in_process_median={d:.0}/s ratio={:.2} one_at_a_time_median={s:.0}/s",
        if opts.sync_full { "full" } else { "normal" },
        p / d
    ));
    Ok(())
}
