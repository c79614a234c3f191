//! A timeline as a Gantt chart: one row per rank, a box per forward or backward with its
//! micro-batch number, one colour per kind of action (lighter for later chunks). The bubble is
//! the empty space.

use std::fmt::Write;

use crate::schedule::Kind;
use crate::simulate::Timeline;

const WIDTH: f64 = 1000.0;
const LABEL: f64 = 70.0;
const ROW: f64 = 30.0;
const TOP: f64 = 40.0;

fn colour(kind: Kind) -> &'static str {
    match kind {
        Kind::Forward => "#4e79a7",
        Kind::Backward => "#59a14f",
        Kind::BackwardInput => "#8cd17d",
        Kind::BackwardWeight => "#f28e2b",
        _ => "#bab0ac",
    }
}

impl Timeline {
    /// The chart as a standalone SVG document, headed by `title` and the bubble.
    pub fn to_svg(&self, title: &str) -> String {
        let origin = self
            .ranks
            .iter()
            .flatten()
            .map(|s| s.start)
            .fold(f64::INFINITY, f64::min);
        let origin = if origin.is_finite() { origin } else { 0.0 };
        let scale = WIDTH / self.makespan().max(f64::MIN_POSITIVE);
        let rows = self.ranks.len() as f64;
        let height = TOP + rows * ROW + 50.0;
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="11">"#,
            LABEL + WIDTH + 20.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{LABEL}" y="20" font-size="14">{} — bubble {:.1}%</text>"#,
            escape(title),
            100.0 * self.bubble()
        );
        for (rank, spans) in self.ranks.iter().enumerate() {
            let y = TOP + rank as f64 * ROW;
            let _ = writeln!(
                svg,
                r##"<text x="4" y="{}">rank {rank}</text><rect x="{LABEL}" y="{y}" width="{WIDTH}" height="{}" fill="#f2f2f2"/>"##,
                y + ROW * 0.6,
                ROW - 4.0
            );
            for span in spans.iter().filter(|s| s.action.kind.is_compute()) {
                let x = LABEL + (span.start - origin) * scale;
                let w = ((span.end - span.start) * scale).max(0.5);
                let chunk = span.action.stage / self.ranks.len();
                let opacity = 1.0 - 0.45 * chunk as f64 / self.virtual_stages.max(1) as f64;
                let _ = writeln!(
                    svg,
                    r##"<rect x="{x:.2}" y="{y}" width="{w:.2}" height="{}" fill="{}" fill-opacity="{opacity:.2}" stroke="#ffffff" stroke-width="0.5"><title>{}</title></rect>"##,
                    ROW - 4.0,
                    colour(span.action.kind),
                    span.action
                );
                if w >= 12.0 {
                    let _ = writeln!(
                        svg,
                        r#"<text x="{:.2}" y="{}" text-anchor="middle" fill="white">{}</text>"#,
                        x + w / 2.0,
                        y + ROW * 0.6,
                        span.action.micro_batch
                    );
                }
            }
        }
        let legend = [
            (Kind::Forward, "forward"),
            (Kind::Backward, "backward"),
            (Kind::BackwardInput, "backward, input half"),
            (Kind::BackwardWeight, "backward, weight half"),
        ];
        let y = TOP + rows * ROW + 15.0;
        for (i, (kind, name)) in legend.iter().enumerate() {
            let x = LABEL + i as f64 * 200.0;
            let _ = writeln!(
                svg,
                r#"<rect x="{x}" y="{y}" width="14" height="14" fill="{}"/><text x="{}" y="{}">{name}</text>"#,
                colour(*kind),
                x + 20.0,
                y + 11.0
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
