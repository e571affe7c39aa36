//! Progress display on stderr, shown only when stderr is a terminal so that logs and pipes stay clean.

use std::future::Future;
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use crate::remote::ProgressSource;

/// A bar over `len` steps, hidden when stderr is not a terminal.
pub fn bar(len: u64, unit: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let template =
        format!("{{spinner}} [{{elapsed_precise}}] {{bar:30}} {{pos}}/{{len}} {unit} {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// Runs `work` while `show` receives the runner's (or server's) live job progress line every 250 ms (only on a
/// terminal, and only for modes that report progress) and `say` every notice of the runner (a lost
/// worker, a retried region; on a terminal or not, so logs keep them), the last ones after `work`
/// ends. Nothing is spawned: the ticks are polled alongside `work`, and dropping the future stops
/// both.
pub async fn with_job_progress<F: Future>(
    runner: &dyn ProgressSource,
    show: &dyn Fn(&str),
    say: &dyn Fn(&str),
    work: F,
) -> F::Output {
    let terminal = std::io::stderr().is_terminal();
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let output = loop {
        tokio::select! {
            output = &mut work => break output,
            _ = tick.tick() => {
                for notice in runner.take_notices().await {
                    say(&notice);
                }
                if terminal && let Some(line) = runner.progress_line().await {
                    show(&line);
                }
            }
        }
    };
    for notice in runner.take_notices().await {
        say(&notice);
    }
    output
}

/// A spinner line for a single query's job progress, hidden when stderr is not a terminal.
pub fn job_line() -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let line = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}") {
        line.set_style(style);
    }
    line
}
