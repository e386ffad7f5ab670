//! Device memory per tag over a run, sampled at every phase boundary and drawn as an SVG
//! chart of stepped lines: one per tag, and the total; under them, a bar for each move that
//! ran behind other work (the trainer's offload and onload on the loop's mover thread), so
//! the moves that overlap the rollout show where they ran.

use std::path::Path;

use plotters::prelude::{
    BLACK, ChartBuilder, Color, IntoDrawingArea, LineSeries, Palette, Palette99, PathElement,
    Rectangle, SVGBackend, WHITE,
};

use super::MetricsError;

/// Device memory at one phase boundary.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineSample {
    /// Seconds since the run started.
    pub seconds: f64,
    /// The boundary (`step 3 after_offload_rollout`).
    pub label: String,
    /// Bytes each tag holds on the device, by `owner/tag` (`train/params`, `rollout/kv_cache`).
    pub tags: Vec<(String, u64)>,
}

impl TimelineSample {
    /// Bytes over all tags.
    pub fn total(&self) -> u64 {
        self.tags.iter().map(|(_, b)| b).sum()
    }
}

/// A move that ran behind other work, in seconds since the run started.
#[derive(Clone, Debug, PartialEq)]
pub struct MoveSpan {
    /// What moved (`offload_train behind`).
    pub name: String,
    /// When it started.
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// The samples of a run, in order, and the moves that ran behind other work.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryTimeline {
    samples: Vec<TimelineSample>,
    moves: Vec<MoveSpan>,
}

/// Height of the bars of moves, as a share of the chart's height.
const MOVE_BAR: f64 = 0.04;

const MIB: f64 = (1u64 << 20) as f64;

impl MemoryTimeline {
    /// Adds a sample.
    pub fn record(&mut self, sample: TimelineSample) {
        self.samples.push(sample);
    }

    /// The samples so far.
    pub fn samples(&self) -> &[TimelineSample] {
        &self.samples
    }

    /// Adds a move that ran behind other work.
    pub fn record_move(&mut self, span: MoveSpan) {
        self.moves.push(span);
    }

    /// The moves so far.
    pub fn moves(&self) -> &[MoveSpan] {
        &self.moves
    }

    /// Every `owner/tag` seen, in order of first appearance.
    pub fn series_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for sample in &self.samples {
            for (name, _) in &sample.tags {
                if !names.contains(name) {
                    names.push(name.clone());
                }
            }
        }
        names
    }

    /// The stepped line of `name` in MiB: each value holds until the next sample.
    fn line(&self, value: impl Fn(&TimelineSample) -> u64) -> Vec<(f64, f64)> {
        let mut points = Vec::with_capacity(self.samples.len() * 2);
        let mut previous: Option<f64> = None;
        for sample in &self.samples {
            let v = value(sample) as f64 / MIB;
            if let Some(p) = previous {
                points.push((sample.seconds, p));
            }
            points.push((sample.seconds, v));
            previous = Some(v);
        }
        points
    }

    /// Draws device memory per tag and in total over time into the SVG file `path`.
    ///
    /// # Errors
    /// [`MetricsError::Draw`] when the chart cannot be drawn or written.
    pub fn write_svg(&self, path: &Path) -> Result<(), MetricsError> {
        let draw_error = |reason: String| MetricsError::Draw {
            path: path.to_path_buf(),
            reason,
        };
        let end = self
            .samples
            .last()
            .map_or(1.0, |s| s.seconds)
            .max(self.moves.iter().map(|m| m.end).fold(0.0, f64::max))
            .max(f64::EPSILON);
        let top = self
            .samples
            .iter()
            .map(TimelineSample::total)
            .max()
            .unwrap_or(0) as f64
            / MIB;
        let top = (top * 1.1).max(1.0);
        super::create_parent(path)?;
        let root = SVGBackend::new(path, (1200, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| draw_error(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("device memory per tag", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..end, 0.0..top)
            .map_err(|e| draw_error(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("seconds since start")
            .y_desc("MiB on the device")
            .draw()
            .map_err(|e| draw_error(e.to_string()))?;
        // The total first, thin, so that each tag's line stays visible on top of it.
        let mut series: Vec<(String, Vec<(f64, f64)>)> =
            vec![("total".to_owned(), self.line(TimelineSample::total))];
        series.extend(self.series_names().into_iter().map(|name| {
            let points = self.line(|s| {
                s.tags
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map_or(0, |(_, b)| *b)
            });
            (name, points)
        }));
        for (index, (name, points)) in series.into_iter().enumerate() {
            let (color, width) = if index == 0 {
                (BLACK.to_rgba(), 1)
            } else {
                (Palette99::pick(index - 1).to_rgba(), 2)
            };
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(width)))
                .map_err(|e| draw_error(e.to_string()))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        // A bar per move along the bottom, one colour per kind of move.
        let mut kinds: Vec<&str> = Vec::new();
        for span in &self.moves {
            if !kinds.contains(&span.name.as_str()) {
                kinds.push(&span.name);
            }
        }
        for (index, kind) in kinds.iter().enumerate() {
            let color = Palette99::pick(60 + index).mix(0.6);
            let bars =
                self.moves.iter().filter(|m| m.name == *kind).map(|m| {
                    Rectangle::new([(m.start, 0.0), (m.end, top * MOVE_BAR)], color.filled())
                });
            chart
                .draw_series(bars)
                .map_err(|e| draw_error(e.to_string()))?
                .label(*kind)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 4), (x + 20, y + 4)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| draw_error(e.to_string()))?;
        root.present().map_err(|e| draw_error(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(seconds: f64, params: u64, kv: u64) -> TimelineSample {
        TimelineSample {
            seconds,
            label: format!("t{seconds}"),
            tags: vec![
                ("train/params".to_owned(), params),
                ("rollout/kv_cache".to_owned(), kv),
            ],
        }
    }

    #[test]
    fn lines_step_from_sample_to_sample() {
        let mut t = MemoryTimeline::default();
        t.record(sample(0.0, 3 << 20, 1 << 20));
        t.record(sample(2.0, 0, 5 << 20));
        assert_eq!(
            t.line(TimelineSample::total),
            vec![(0.0, 4.0), (2.0, 4.0), (2.0, 5.0)]
        );
        assert_eq!(t.series_names(), ["train/params", "rollout/kv_cache"]);
    }

    #[test]
    fn svg_names_every_tag_and_the_total() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("timeline.svg");
        let mut t = MemoryTimeline::default();
        for (i, (p, k)) in [(7u64, 2u64), (0, 9), (7, 0), (0, 9)].iter().enumerate() {
            t.record(sample(i as f64 * 1.5, p << 20, k << 20));
        }
        t.write_svg(&path).unwrap();
        let rects = std::fs::read_to_string(&path)
            .unwrap()
            .matches("<rect")
            .count();
        t.record_move(MoveSpan {
            name: "offload_train behind".to_owned(),
            start: 1.0,
            end: 7.5,
        });
        t.write_svg(&path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("offload_train behind"), "the move's legend");
        assert!(
            svg.matches("<rect").count() >= rects + 2,
            "the move's bar and its legend swatch"
        );
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        for name in [
            "train/params",
            "rollout/kv_cache",
            "total",
            "MiB on the device",
        ] {
            assert!(svg.contains(name), "{name} missing from the svg");
        }
        assert!(svg.matches("<polyline").count() >= 3);
    }
}
