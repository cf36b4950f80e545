//! PNG charts with `plotters`: latency CDFs of one or more runs, and throughput and goodput against request rate for sweeps.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::run::RunResult;
use super::{LoadError, SweepResult};

static FONT: Once = Once::new();

/// The embedded DejaVu Sans (no system fonts needed).
fn fonts() {
    FONT.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

fn err(e: impl std::fmt::Display) -> LoadError {
    LoadError::Invalid(format!("plot: {e}"))
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draw the legend at `pos` and write the PNG.
fn finish<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    root: &DrawingArea<BitMapBackend<'b>, Shift>,
    pos: SeriesLabelPosition,
) -> Result<(), LoadError> {
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// One latency of a run as sorted milliseconds.
fn values(r: &RunResult, metric: &str) -> Vec<f64> {
    let mut v: Vec<f64> = Vec::new();
    for q in r.requests.iter().filter(|q| !q.warmup && q.completed()) {
        match metric {
            "ttft" => v.extend(q.ttft_ms()),
            "tpot" => v.extend(q.tpot_ms()),
            "e2e" => v.push(q.e2e_ms),
            _ => v.extend(q.itl_per_token()),
        }
    }
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    v
}

/// `cdf_ttft.png`, `cdf_tpot.png`, `cdf_itl.png`, `cdf_e2e.png` in `dir`, one line per run.
pub fn cdfs(runs: &[(&str, &RunResult)], dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    fonts();
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut out = Vec::new();
    for (metric, title) in [
        ("ttft", "Time to first token"),
        ("tpot", "Time per output token"),
        ("itl", "Inter-token latency (per token)"),
        ("e2e", "End-to-end latency"),
    ] {
        let series: Vec<(&str, Vec<f64>)> =
            runs.iter().map(|(l, r)| (*l, values(r, metric))).collect();
        let xmax = series
            .iter()
            .filter_map(|(_, v)| v.last().copied())
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.05;
        let path = dir.join(format!("cdf_{metric}.png"));
        {
            let root = BitMapBackend::new(&path, (900, 560)).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            let mut chart = ChartBuilder::on(&root)
                .caption(format!("{title} (CDF)"), ("sans-serif", 24))
                .margin(16)
                .x_label_area_size(44)
                .y_label_area_size(56)
                .build_cartesian_2d(0.0..xmax, 0.0..1.0)
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("milliseconds")
                .y_desc("fraction of requests (tokens for ITL)")
                .draw()
                .map_err(err)?;
            for (k, (label, v)) in series.iter().enumerate() {
                if v.is_empty() {
                    continue;
                }
                let c = COLORS[k % COLORS.len()];
                let n = v.len() as f64;
                let step = (v.len() / 2000).max(1);
                let pts: Vec<(f64, f64)> = v
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| i % step == 0 || *i + 1 == v.len())
                    .map(|(i, &x)| (x, (i + 1) as f64 / n))
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                    .map_err(err)?
                    .label(*label)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                    });
            }
            finish(&mut chart, &root, SeriesLabelPosition::LowerRight)?;
        }
        out.push(path);
    }
    Ok(out)
}

/// `sweep_throughput.png` and `sweep_goodput.png`: one line per sweep against request rate.
pub fn sweeps(sweeps: &[(&str, &SweepResult)], dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    fonts();
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut out = Vec::new();
    type Pick = fn(&RunResult) -> f64;
    let charts: [(&str, &str, &str, Pick); 2] = [
        (
            "sweep_throughput.png",
            "Output token throughput",
            "output tokens / s",
            |r| r.summary.output_token_throughput,
        ),
        (
            "sweep_goodput.png",
            "Goodput under the SLO",
            "good requests / s",
            |r| r.summary.goodput,
        ),
    ];
    let xmax = sweeps
        .iter()
        .flat_map(|(_, s)| s.runs.iter().filter_map(RunResult::rate))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    for (file, title, ydesc, pick) in charts {
        let ymax = sweeps
            .iter()
            .flat_map(|(_, s)| s.runs.iter().map(pick))
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.15;
        let path = dir.join(file);
        {
            let root = BitMapBackend::new(&path, (900, 560)).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            let mut chart = ChartBuilder::on(&root)
                .caption(title, ("sans-serif", 24))
                .margin(16)
                .x_label_area_size(44)
                .y_label_area_size(64)
                .build_cartesian_2d(0.0..xmax, 0.0..ymax)
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("request rate (req/s)")
                .y_desc(ydesc)
                .draw()
                .map_err(err)?;
            for (k, (label, s)) in sweeps.iter().enumerate() {
                let c = COLORS[k % COLORS.len()];
                let pts: Vec<(f64, f64)> = s
                    .runs
                    .iter()
                    .filter_map(|r| Some((r.rate()?, pick(r))))
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                    .map_err(err)?
                    .label(*label)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                    });
                chart
                    .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
                    .map_err(err)?;
            }
            finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
        }
        out.push(path);
    }
    Ok(out)
}
