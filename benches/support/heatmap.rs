//! A heatmap of speedups like the BinX RFC's figure, drawn into a PNG with
//! a built-in 5x7 pixel font (no font files, no plotting stack).

use std::path::Path;

/// One panel: `values[row][col]` is a ratio (None: not measured).
pub(crate) struct Panel<'a> {
    pub title: &'a str,
    pub rows: &'a [String],
    pub cols: &'a [String],
    pub values: Vec<Vec<Option<f64>>>,
}

const SCALE: usize = 2;
const GLYPH_W: usize = 5 * SCALE;
const GLYPH_H: usize = 7 * SCALE;
const ADVANCE: usize = GLYPH_W + SCALE;
const CELL_W: usize = 96;
const CELL_H: usize = 40;
const LABEL_W: usize = 96;
const TITLE_H: usize = 36;
const HEADER_H: usize = 28;
const MARGIN: usize = 16;
const FOOTER_H: usize = 28;

struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    fn new(width: usize, height: usize) -> Self {
        Canvas {
            width,
            height,
            pixels: vec![255; width * height * 3],
        }
    }

    fn fill(&mut self, x: usize, y: usize, w: usize, h: usize, rgb: [u8; 3]) {
        for yy in y..(y + h).min(self.height) {
            for xx in x..(x + w).min(self.width) {
                let i = (yy * self.width + xx) * 3;
                self.pixels[i..i + 3].copy_from_slice(&rgb);
            }
        }
    }

    fn text(&mut self, x: usize, y: usize, text: &str, rgb: [u8; 3]) {
        for (n, c) in text.chars().enumerate() {
            let rows = glyph(c);
            for (row, bits) in rows.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0x10 >> col) != 0 {
                        self.fill(
                            x + n * ADVANCE + col * SCALE,
                            y + row * SCALE,
                            SCALE,
                            SCALE,
                            rgb,
                        );
                    }
                }
            }
        }
    }

    fn text_centered(&mut self, cx: usize, y: usize, text: &str, rgb: [u8; 3]) {
        let w = text.chars().count() * ADVANCE;
        self.text(cx.saturating_sub(w / 2), y, text, rgb);
    }
}

/// White at 1x, blue above (full at 4x), red below (full at 1/4x).
fn color(ratio: f64) -> [u8; 3] {
    let t = (ratio.max(1e-9).log2() / 2.0).clamp(-1.0, 1.0);
    let target = if t >= 0.0 {
        [33, 102, 172]
    } else {
        [178, 24, 43]
    };
    let t = t.abs();
    let mix = |a: u8| (255.0 + (f64::from(a) - 255.0) * t).round() as u8;
    [mix(target[0]), mix(target[1]), mix(target[2])]
}

/// Draws the panels side by side and writes a PNG.
pub(crate) fn write_png(path: &Path, caption: &str, panels: &[Panel]) -> std::io::Result<()> {
    let panel_w = |p: &Panel| LABEL_W + p.cols.len() * CELL_W + MARGIN;
    let width = MARGIN + panels.iter().map(panel_w).sum::<usize>();
    let rows = panels.iter().map(|p| p.rows.len()).max().unwrap_or(0);
    let height = MARGIN + TITLE_H + HEADER_H + rows * CELL_H + FOOTER_H + MARGIN;
    let mut canvas = Canvas::new(width, height);
    let black = [0, 0, 0];
    let mut x0 = MARGIN;
    for panel in panels {
        let grid_x = x0 + LABEL_W;
        let grid_y = MARGIN + TITLE_H + HEADER_H;
        canvas.text(x0, MARGIN, &panel.title.to_uppercase(), black);
        for (c, label) in panel.cols.iter().enumerate() {
            canvas.text_centered(
                grid_x + c * CELL_W + CELL_W / 2,
                grid_y - HEADER_H + 4,
                label,
                black,
            );
        }
        for (r, label) in panel.rows.iter().enumerate() {
            let y = grid_y + r * CELL_H;
            canvas.text(x0, y + (CELL_H - GLYPH_H) / 2, &label.to_uppercase(), black);
            for c in 0..panel.cols.len() {
                let x = grid_x + c * CELL_W;
                let value = panel
                    .values
                    .get(r)
                    .and_then(|row| row.get(c))
                    .copied()
                    .flatten();
                let (bg, text) = match value {
                    Some(v) => (color(v), format!("{v:.2}X")),
                    None => ([230, 230, 230], "-".to_string()),
                };
                canvas.fill(x + 1, y + 1, CELL_W - 2, CELL_H - 2, bg);
                let dark = bg.iter().map(|&b| u32::from(b)).sum::<u32>() < 3 * 140;
                let ink = if dark { [255, 255, 255] } else { black };
                canvas.text_centered(x + CELL_W / 2, y + (CELL_H - GLYPH_H) / 2, &text, ink);
            }
        }
        x0 += panel_w(panel);
    }
    canvas.text(
        MARGIN,
        height - MARGIN - GLYPH_H,
        &caption.to_uppercase(),
        black,
    );

    let file = std::fs::File::create(path)?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width as u32, height as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(std::io::Error::other)?;
    writer
        .write_image_data(&canvas.pixels)
        .map_err(std::io::Error::other)?;
    writer.finish().map_err(std::io::Error::other)
}

/// 5x7 glyphs, one byte per row, bit 4 leftmost. Lower case draws as upper.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        '.' => [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C],
        ',' => [0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08],
        '/' => [0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00],
        '-' => [0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00],
        ':' => [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '=' => [0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00],
        '>' => [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08],
        '<' => [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02],
        ' ' => [0; 7],
        _ => [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F],
    }
}
