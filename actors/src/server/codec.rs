//! Newline framing that survives bad input: a line longer than the limit is discarded up to its newline and reported, bytes are not checked for UTF-8 here (the session does, per line), so the connection lives on.

use bytes::{Buf, BytesMut};
use tokio_util::codec::Decoder;

/// One framed line.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// A line without its `\n` (and without a trailing `\r`).
    Line(BytesMut),
    /// A line over the limit was dropped; `bytes` of it were seen.
    TooLong { bytes: usize },
}

/// `\n`-delimited lines of at most `max` bytes.
#[derive(Debug)]
pub struct LineCodec {
    max: usize,
    /// Inside an over-long line: bytes dropped so far.
    discarding: Option<usize>,
    /// Bytes of `buf` already searched for `\n`.
    scanned: usize,
}

impl LineCodec {
    pub fn new(max: usize) -> LineCodec {
        LineCodec {
            max,
            discarding: None,
            scanned: 0,
        }
    }
}

impl Decoder for LineCodec {
    type Item = Frame;
    type Error = std::io::Error;

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, std::io::Error> {
        loop {
            let nl = buf[self.scanned..]
                .iter()
                .position(|&b| b == b'\n')
                .map(|i| self.scanned + i);
            if let Some(dropped) = self.discarding {
                match nl {
                    Some(i) => {
                        buf.advance(i + 1);
                        self.scanned = 0;
                        self.discarding = None;
                        return Ok(Some(Frame::TooLong { bytes: dropped + i }));
                    }
                    None => {
                        self.discarding = Some(dropped + buf.len());
                        buf.clear();
                        self.scanned = 0;
                        return Ok(None);
                    }
                }
            }
            // A trailing `\r` is not part of the line: `max` bytes and `\r\n` fit.
            let max = self.max;
            let over = |len: usize, last: Option<&u8>| {
                len > max && !(len == max + 1 && last == Some(&b'\r'))
            };
            match nl {
                Some(i) if over(i, i.checked_sub(1).and_then(|j| buf.get(j))) => {
                    // Over the limit even though its end is here: drop it.
                    buf.advance(i + 1);
                    self.scanned = 0;
                    return Ok(Some(Frame::TooLong { bytes: i }));
                }
                Some(i) => {
                    let mut line = buf.split_to(i + 1);
                    line.truncate(i);
                    if line.last() == Some(&b'\r') {
                        line.truncate(i - 1);
                    }
                    self.scanned = 0;
                    return Ok(Some(Frame::Line(line)));
                }
                None if over(buf.len(), buf.last()) => {
                    self.discarding = Some(0);
                    continue;
                }
                None => {
                    self.scanned = buf.len();
                    return Ok(None);
                }
            }
        }
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, std::io::Error> {
        if let Some(f) = self.decode(buf)? {
            return Ok(Some(f));
        }
        if let Some(dropped) = self.discarding.take() {
            return Ok(Some(Frame::TooLong { bytes: dropped }));
        }
        if buf.is_empty() {
            return Ok(None);
        }
        // A last line without its newline.
        let mut line = buf.split_to(buf.len());
        self.scanned = 0;
        if line.last() == Some(&b'\r') {
            line.truncate(line.len() - 1);
        }
        Ok(Some(Frame::Line(line)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(codec: &mut LineCodec, chunks: &[&[u8]]) -> Vec<Frame> {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for c in chunks {
            buf.extend_from_slice(c);
            while let Some(f) = codec.decode(&mut buf).expect("decode") {
                out.push(f);
            }
        }
        while let Some(f) = codec.decode_eof(&mut buf).expect("eof") {
            out.push(f);
        }
        out
    }

    fn line(s: &str) -> Frame {
        Frame::Line(BytesMut::from(s.as_bytes()))
    }

    #[test]
    fn splits_lines_across_chunks_and_strips_cr() {
        let mut c = LineCodec::new(16);
        let f = frames(&mut c, &[b"ab", b"c\r\nde\n", b"\nlast"]);
        assert_eq!(f, vec![line("abc"), line("de"), line(""), line("last")]);
    }

    #[test]
    fn over_long_lines_are_dropped_up_to_their_newline() {
        let mut c = LineCodec::new(4);
        let f = frames(&mut c, &[b"0123456789", b"abc", b"\nok\n12345\nxy"]);
        assert_eq!(
            f,
            vec![
                Frame::TooLong { bytes: 13 },
                line("ok"),
                Frame::TooLong { bytes: 5 },
                line("xy")
            ]
        );
        // A line of exactly the limit passes.
        let mut c = LineCodec::new(4);
        assert_eq!(frames(&mut c, &[b"1234\n"]), vec![line("1234")]);
    }

    /// `max` bytes followed by `\r\n` is a line of `max` bytes, whole or split before the `\n`.
    #[test]
    fn a_line_of_the_limit_with_crlf_fits() {
        let mut c = LineCodec::new(4);
        let f = frames(&mut c, &[b"abcd\r\nabcd\r", b"\nabcde\r\nok\n"]);
        assert_eq!(
            f,
            vec![
                Frame::Line(BytesMut::from(&b"abcd"[..])),
                Frame::Line(BytesMut::from(&b"abcd"[..])),
                Frame::TooLong { bytes: 6 },
                Frame::Line(BytesMut::from(&b"ok"[..])),
            ]
        );
    }

    #[test]
    fn an_endless_line_does_not_grow_the_buffer() {
        let mut c = LineCodec::new(8);
        let mut buf = BytesMut::new();
        for _ in 0..1000 {
            buf.extend_from_slice(b"0123456789");
            assert_eq!(c.decode(&mut buf).expect("decode"), None);
            assert!(buf.len() <= 8, "{} bytes held", buf.len());
        }
        buf.extend_from_slice(b"\nok\n");
        assert_eq!(
            c.decode(&mut buf).expect("decode"),
            Some(Frame::TooLong { bytes: 10_000 })
        );
        assert_eq!(c.decode(&mut buf).expect("decode"), Some(line("ok")));
    }

    #[test]
    fn invalid_utf8_is_framed_not_rejected() {
        let mut c = LineCodec::new(16);
        let f = frames(&mut c, &[b"\xff\xfe\n{}\n"]);
        assert_eq!(
            f,
            vec![Frame::Line(BytesMut::from(&b"\xff\xfe"[..])), line("{}")]
        );
    }
}
