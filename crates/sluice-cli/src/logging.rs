//! The process's log lines and trace export: one tracing subscriber, installed at start.
//!
//! ```text
//!  driver spans (job ─► stage ─► task) ──────────┐                 ┌─► stderr: text or JSON lines
//!  worker spans (task attempt) and events ───────┼─► subscriber ──┤   (filter: SLUICE_LOG)
//!                                                │                 └─► OTLP/gRPC exporter (feature
//!                                                                      `otlp`, --otlp-endpoint)
//! ```
//!
//! Log lines go to stderr (results own stdout). `SLUICE_LOG` filters them with tracing's directive
//! syntax (`info`, `sluice::driver=debug`); the default is `warn`, so a command's stderr shows its
//! progress and errors only. Worker processes that `--mode cluster` starts inherit `SLUICE_LOG`,
//! and get this process's log format and OTLP endpoint (flag or variable) through
//! [`worker_env`]; their lines reach the client's stderr prefixed with the worker.
//! Invariant: installing fails with a clear error rather than running without the asked-for export.

use std::str::FromStr;
use std::sync::OnceLock;

use sluice_engine::SluiceError;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The environment variable holding the log filter.
pub const LOG_FILTER_VAR: &str = "SLUICE_LOG";

/// The environment variable holding the log format.
pub const LOG_FORMAT_VAR: &str = "SLUICE_LOG_FORMAT";

/// The environment variable holding the OTLP endpoint.
pub const OTLP_ENDPOINT_VAR: &str = "SLUICE_OTLP_ENDPOINT";

/// What [`install`] set up, as the variables a worker process needs to do the same.
static WORKER_ENV: OnceLock<Vec<(String, String)>> = OnceLock::new();

/// The variables each spawned worker process gets so that it logs and exports as this process
/// does (empty before [`install`]).
pub fn worker_env() -> Vec<(String, String)> {
    WORKER_ENV.get().cloned().unwrap_or_default()
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One human-readable line per event, with its spans' fields.
    #[default]
    Text,
    /// One JSON object per event: `timestamp`, `level`, `target`, `fields`, `span`, `spans`.
    Json,
}

impl LogFormat {
    /// The name `--log-format` takes.
    pub fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("'{text}' is not a log format (text or json)")),
        }
    }
}

/// Keeps the trace export running; dropping it flushes what is buffered.
#[derive(Debug, Default)]
pub struct LoggingGuard {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for LoggingGuard {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("warning: the OTLP trace export did not finish: {error}");
        }
    }
}

/// Installs the subscriber: log lines in `format` on stderr, filtered by `SLUICE_LOG`, and spans
/// exported over OTLP/gRPC to `otlp_endpoint` when given. Call inside the control runtime (the
/// exporter's connection lives there).
pub fn install(
    format: LogFormat,
    otlp_endpoint: Option<&str>,
) -> Result<LoggingGuard, SluiceError> {
    let filter = match std::env::var(LOG_FILTER_VAR) {
        Ok(directives) => EnvFilter::try_new(&directives).map_err(|e| SluiceError::Config {
            source_name: LOG_FILTER_VAR.to_string(),
            message: format!("'{directives}' is not a log filter: {e}"),
        })?,
        Err(_) => EnvFilter::new("warn"),
    };
    // Colours only on a terminal: a log piped to a file or another program reads as plain text.
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let lines = match format {
        LogFormat::Text => lines.boxed(),
        LogFormat::Json => lines.json().with_current_span(true).boxed(),
    };
    let mut env = vec![(LOG_FORMAT_VAR.to_string(), format.name().to_string())];
    if let Some(endpoint) = otlp_endpoint {
        env.push((OTLP_ENDPOINT_VAR.to_string(), endpoint.to_string()));
    }
    let _ = WORKER_ENV.set(env);
    let registry = tracing_subscriber::registry().with(lines.with_filter(filter));
    let guard = LoggingGuard::default();
    match otlp_endpoint {
        None => registry.try_init().map_err(already_installed)?,
        #[cfg(feature = "otlp")]
        Some(endpoint) => {
            let (layer, provider) = otlp::layer(endpoint)?;
            registry.with(layer).try_init().map_err(already_installed)?;
            return Ok(LoggingGuard {
                provider: Some(provider),
            });
        }
        #[cfg(not(feature = "otlp"))]
        Some(_) => {
            return Err(SluiceError::invalid(
                "--otlp-endpoint needs a sluice built with the `otlp` feature \
                 (cargo build --release --features sluice-cli/otlp)",
            ));
        }
    }
    Ok(guard)
}

fn already_installed(error: impl std::fmt::Display) -> SluiceError {
    SluiceError::invalid(format!(
        "the log subscriber could not be installed: {error}"
    ))
}

#[cfg(feature = "otlp")]
mod otlp {
    //! The OTLP/gRPC span export: a batch processor over tonic, every span of the process.

    use opentelemetry::trace::TracerProvider;
    use opentelemetry_otlp::WithExportConfig;
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use sluice_engine::SluiceError;
    use tracing_subscriber::Layer;
    use tracing_subscriber::registry::LookupSpan;

    /// The layer exporting spans to `endpoint`, and its provider (shut down to flush).
    pub fn layer<S>(
        endpoint: &str,
    ) -> Result<(Box<dyn Layer<S> + Send + Sync>, SdkTracerProvider), SluiceError>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .map_err(|e| {
                SluiceError::invalid(format!("the OTLP exporter for {endpoint} failed: {e}"))
            })?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name("sluice").build())
            .build();
        let tracer = provider.tracer("sluice");
        let layer = tracing_opentelemetry::layer().with_tracer(tracer).boxed();
        Ok((layer, provider))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_by_name_and_others_are_refused() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!(" Text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert_eq!(
            "yaml".parse::<LogFormat>(),
            Err("'yaml' is not a log format (text or json)".to_string())
        );
    }
}
