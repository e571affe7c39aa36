//! The simulation at a size CI runs: every job's answer is whole, every loss is seen and repaired,
//! and the counts add up.

use super::*;

/// The simulation, failing instead of hanging if the driver never finishes (the clock may be
/// paused: the limit is virtual time then, far beyond any capacity wait).
async fn run(config: &SimulationConfig) -> SimulationReport {
    tokio::time::timeout(Duration::from_secs(600), simulate(config))
        .await
        .expect("the simulation did not finish")
        .unwrap()
}

fn small(losses: usize, blocking: bool) -> SimulationConfig {
    SimulationConfig {
        workers: 40,
        slots: 4,
        jobs: 6,
        concurrent_jobs: 2,
        stages: 5,
        width: 60,
        blocking,
        task_ms: (1, 50),
        losses,
        seed: 42,
    }
}

#[tokio::test]
async fn a_blocking_simulation_without_losses_runs_each_task_once_and_measures_every_later_stage() {
    let report = run(&small(0, true)).await;
    assert_eq!(report.job_errors, Vec::<String>::new());
    assert_eq!(report.jobs_succeeded, 6);
    // 6 jobs x 5 stages x 60 tasks, each placed once and reported twice.
    assert_eq!(report.attempts, 1800);
    assert_eq!(report.reports, 3600);
    assert_eq!(report.transitions(), 5400);
    assert_eq!(
        (report.stops, report.workers_lost, report.regions_retried),
        (0, 0, 0)
    );
    // Every stage after the first waited for the one before it: 4 per job.
    assert_eq!(report.placements.len(), 24);
    assert_eq!(report.history_jobs, 6);
    // Two jobs of 60-task stages at once on 160 slots: at most two stages run together.
    assert!(report.peak_running <= 120, "{report}");
    let text = report.to_string();
    assert!(
        text.contains("jobs succeeded: 6/6; attempts 1800 for 1800 tasks"),
        "{text}"
    );
}

#[tokio::test]
async fn workers_lost_mid_run_are_replaced_and_every_job_still_returns_each_row_once() {
    let report = run(&small(3, true)).await;
    assert_eq!(report.job_errors, Vec::<String>::new());
    assert_eq!(report.jobs_succeeded, 6);
    assert_eq!(report.workers_lost, 3);
    // Each victim ran attempts, which the driver charged and ran again (with their regions).
    assert!(report.regions_retried >= 1, "{report}");
    assert!(report.attempts > 1800, "{report}");
    assert_eq!(report.history_jobs, 6);
}

#[tokio::test]
async fn a_pipelined_job_is_one_region_placed_whole() {
    let mut config = small(0, false);
    // 300 tasks in one region: 100 workers of 4 slots hold it.
    config.workers = 100;
    config.jobs = 2;
    config.concurrent_jobs = 1;
    let report = run(&config).await;
    assert_eq!(report.job_errors, Vec::<String>::new());
    assert_eq!(report.jobs_succeeded, 2);
    assert_eq!(report.attempts, 600);
    // Each job's 300 tasks ran at once: its one region was placed whole, never in parts.
    assert_eq!(report.peak_running, 300, "{report}");
}

#[tokio::test]
async fn a_job_larger_than_the_fleet_fails_with_the_slots_it_needed_rather_than_hang() {
    let mut config = small(0, false);
    config.workers = 2;
    config.jobs = 1;
    config.concurrent_jobs = 1;
    // 300 tasks in one pipelined region, 8 slots: short of capacity. The default capacity wait
    // is a minute; the simulation makes it short through a paused clock instead of waiting.
    tokio::time::pause();
    let report = run(&config).await;
    assert_eq!(report.jobs_succeeded, 0);
    assert_eq!(report.job_errors.len(), 1, "{report}");
    assert!(
        report.job_errors[0].contains("300") && report.job_errors[0].contains("capacity_wait"),
        "{report}"
    );
}
