//! A guest's stdout and stderr: what it prints (`println!`, `eprintln!`, a panic's message)
//! becomes lines of the tenant's plugin log, under the log's caps. Writing never fails, so a
//! chatty guest is never broken by the host; past the cap its output is dropped, so it cannot
//! make the host keep more than a log's worth of text.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Most bytes one write is permitted (the guest splits larger writes).
const WRITE_PERMIT: usize = 64 << 10;

/// One of a guest's output streams, kept as lines.
#[derive(Clone)]
pub(super) struct GuestOutput {
    lines: Arc<Mutex<Lines>>,
    max_lines: usize,
    max_line: usize,
}

#[derive(Default)]
struct Lines {
    /// The line being written.
    partial: Vec<u8>,
    /// Lines ended since the last take.
    done: Vec<String>,
    /// Lines kept over the instance's life (the cap counts these).
    kept: usize,
}

impl GuestOutput {
    /// A stream that keeps at most `max_lines` lines of at most `max_line` bytes each.
    pub(super) fn new(max_lines: usize, max_line: usize) -> Self {
        Self {
            lines: Arc::new(Mutex::new(Lines::default())),
            max_lines,
            max_line,
        }
    }

    fn write_bytes(&self, mut bytes: &[u8]) {
        let mut l = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        while !bytes.is_empty() {
            if l.kept >= self.max_lines {
                return;
            }
            let (line, rest, ended) = match bytes.iter().position(|&b| b == b'\n') {
                Some(i) => (&bytes[..i], &bytes[i + 1..], true),
                None => (bytes, &[][..], false),
            };
            let room = self.max_line.saturating_sub(l.partial.len());
            l.partial.extend_from_slice(&line[..line.len().min(room)]);
            if ended {
                l.end_line();
            }
            bytes = rest;
        }
    }

    /// The lines written since the last take, the unfinished one too (a call has ended).
    pub(super) fn take(&self) -> Vec<String> {
        let mut l = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if !l.partial.is_empty() && l.kept < self.max_lines {
            l.end_line();
        }
        l.partial.clear();
        std::mem::take(&mut l.done)
    }
}

impl Lines {
    fn end_line(&mut self) {
        let text = String::from_utf8_lossy(&self.partial).into_owned();
        self.partial.clear();
        self.done.push(text);
        self.kept += 1;
    }
}

#[async_trait::async_trait]
impl OutputStream for GuestOutput {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.write_bytes(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

#[async_trait::async_trait]
impl Pollable for GuestOutput {
    async fn ready(&mut self) {}
}

impl AsyncWrite for GuestOutput {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.write_bytes(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_becomes_capped_lines() {
        let out = GuestOutput::new(3, 5);
        out.write_bytes(b"hello world\npart");
        assert_eq!(out.take(), ["hello", "part"]);
        out.write_bytes(b"\n\n");
        assert_eq!(out.take(), [""], "the cut line was ended by the take; one empty line");
        out.write_bytes(b"x\ny\nz\n");
        assert_eq!(
            out.take(),
            Vec::<String>::new(),
            "three lines kept over its life: no more"
        );
        let out = GuestOutput::new(10, 64);
        out.write_bytes("é\u{1b}[2J".as_bytes());
        out.write_bytes(&[0xff, b'\n']);
        assert_eq!(out.take(), ["é\u{1b}[2J\u{fffd}"]);
    }
}
