//! What every listening process shares: accepting connections until shutdown, and the shutdown
//! signal itself.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

/// The next connection, or `None` once `stop` resolves. An accept error (out of descriptors,
/// say) backs off instead of spinning.
pub async fn accept<F: std::future::Future<Output = ()>>(
    listener: &TcpListener,
    mut stop: std::pin::Pin<&mut F>,
) -> Option<(tokio::net::TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => return Some(a),
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = &mut stop => return None,
        }
    }
}

/// Resolves at SIGTERM or SIGINT (never, where the handlers cannot be set).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without signal handlers, run until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
