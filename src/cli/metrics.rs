//! `clawmux metrics`: the broker's `/metrics`, printed or written for
//! node_exporter's textfile collector.
//!
//! Prometheus cannot scrape a unix socket, and the broker listens on no TCP
//! port on purpose. So a timer runs `clawmux metrics --textfile DIR` (see
//! `systemd/clawmux-metrics.{service,timer}`) and node_exporter, started
//! with `--collector.textfile.directory=DIR`, serves the file with its own
//! metrics. The file is replaced atomically (written under a temporary
//! name, then renamed), as the collector requires.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use http::{Method, StatusCode};
use http_body_util::BodyExt;

use super::{BrokerArgs, CliError};

/// The file written in `--textfile DIR` (node_exporter reads `*.prom`).
pub const TEXTFILE_NAME: &str = "clawmux.prom";

#[derive(Args, Debug)]
pub struct MetricsArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Write `DIR/clawmux.prom` (atomically) for node_exporter's textfile collector instead of printing; with a `clawmux_up` series, 0 when the broker cannot be reached.
    #[arg(long, value_name = "DIR")]
    pub textfile: Option<PathBuf>,
}

const UP_HELP: &str =
    "# HELP clawmux_up Whether clawmux metrics could read the broker's /metrics.\n# TYPE clawmux_up gauge\n";

pub async fn run(args: MetricsArgs) -> Result<u8, CliError> {
    let scraped = scrape(&args.broker).await;
    let Some(dir) = &args.textfile else {
        let text = scraped?;
        let mut out = std::io::stdout();
        let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
        return Ok(0);
    };
    let (text, result) = match scraped {
        Ok(text) => (format!("{UP_HELP}clawmux_up 1\n{text}"), Ok(0)),
        // A broker that is down is reported as such, not as stale numbers.
        Err(e) => (format!("{UP_HELP}clawmux_up 0\n"), Err(e)),
    };
    write_atomically(dir, &text).map_err(|e| {
        CliError::Answer(format!(
            "cannot write {}: {e}",
            dir.join(TEXTFILE_NAME).display()
        ))
    })?;
    result
}

async fn scrape(broker: &BrokerArgs) -> Result<String, CliError> {
    let resp = broker
        .client()
        .send(Method::GET, "/metrics", &[], None)
        .await?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| CliError::Answer(format!("the broker's answer was cut off: {e}")))?
        .to_bytes();
    if status != StatusCode::OK {
        return Err(CliError::Answer(format!(
            "the broker answered {status}: {}",
            String::from_utf8_lossy(&body)
        )));
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// `dir/clawmux.prom`, replaced in one rename so the collector never reads
/// half a file.
fn write_atomically(dir: &Path, text: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{TEXTFILE_NAME}.{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(TEXTFILE_NAME)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
