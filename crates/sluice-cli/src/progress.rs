//! Progress display on stderr, shown only when stderr is a terminal so that logs and pipes stay clean.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

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
