use runwarden::Supervisor;
use runwarden::board::NewTask;
use runwarden::config::{AssigneeConfig, Config, ShutdownMode};
use std::time::Duration;

#[test]
fn race() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::with_data_dir(dir.path());
    config.supervisor.tick = Duration::from_millis(5);
    config.supervisor.shutdown = ShutdownMode::Terminate;
    config.supervisor.synchronous = runwarden::config::Synchronous::Normal;
    let mut a = AssigneeConfig::new(["sh", "-c", "exit 0"]);
    a.max_in_progress = 6;
    config.assignees.insert("a".into(), a);
    config.supervisor.max_in_progress = 6;
    let sup = Supervisor::start(config).unwrap();
    let ids: Vec<_> = (0..300)
        .map(|i| {
            sup.add_task(NewTask::titled(format!("t{i}")).for_assignee("a"))
                .unwrap()
                .id
        })
        .collect();
    let mut bad = 0;
    for id in ids {
        let t = sup.wait_for(id, Duration::from_secs(60)).unwrap();
        let d = sup.task(id).unwrap();
        for r in &d.runs {
            if r.exit_code != Some(0) {
                bad += 1;
                eprintln!(
                    "task {id} {:?} run {:?} code {:?} sig {:?} err {:?}",
                    t.status, r.outcome, r.exit_code, r.exit_signal, r.error
                );
            }
        }
    }
    assert_eq!(bad, 0);
}
