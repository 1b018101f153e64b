//! The console's memory: every page it answers is counted against a budget of bytes until the
//! client has taken it (the body goes out in chunks, each made when the connection can take it,
//! so a client that reads slowly keeps its page counted, not hidden in a socket's buffer). A page
//! that does not fit is refused (503), a page larger than [`PAGE_MAX`] too (413): whatever clients
//! ask, the console holds at most [`BUDGET`] of pages.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of pages the console holds at once.
pub const BUDGET: usize = 32 * 1024 * 1024;
/// The largest page the console answers.
pub const PAGE_MAX: usize = 8 * 1024 * 1024;
/// The bytes a page is sent in.
const CHUNK: usize = 64 * 1024;

/// The budget, shared by the console's requests.
#[derive(Clone)]
pub(super) struct PageBudget(Arc<Semaphore>);

impl PageBudget {
    pub(super) fn new() -> Self {
        PageBudget(Arc::new(Semaphore::new(BUDGET)))
    }

    /// `bytes` as a body counted against the budget until it is sent, or why not.
    pub(super) fn body(&self, bytes: Vec<u8>) -> Result<Body, (StatusCode, String)> {
        if bytes.len() > PAGE_MAX {
            return Err((
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "this page would be {} bytes, over the console's {PAGE_MAX}: narrow the filter or lower the limit",
                    bytes.len()
                ),
            ));
        }
        let n = u32::try_from(bytes.len().max(1)).unwrap_or(u32::MAX);
        let permit = self.0.clone().try_acquire_many_owned(n).map_err(|_| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "the console is busy (the pages in flight fill its memory budget); try again"
                    .into(),
            )
        })?;
        Ok(Body::from_stream(chunks(Bytes::from(bytes), permit)))
    }
}

/// The page in chunks; the permit goes with the last one.
fn chunks(
    bytes: Bytes,
    permit: OwnedSemaphorePermit,
) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    futures_util::stream::unfold(Some((bytes, permit)), |state| async move {
        let (mut rest, permit) = state?;
        if rest.is_empty() {
            drop(permit);
            return None;
        }
        let chunk = rest.split_to(rest.len().min(CHUNK));
        Some((Ok(chunk), Some((rest, permit))))
    })
}
