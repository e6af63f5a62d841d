//! Splitting a frame body into pages by a list of sizes, without copying.

use bytes::Bytes;
use thiserror::Error;

/// The page sizes do not describe the body.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("page sizes add up to {declared} bytes but the body has {actual}")]
pub struct PageSplitError {
    /// The sum of the declared page sizes.
    pub declared: u128,
    /// The body's length.
    pub actual: usize,
}

/// Splits `body` into pages of `sizes`, in order. The sizes must add up to
/// the body's length exactly; each page shares the body's memory.
pub fn split_pages(body: &Bytes, sizes: &[u64]) -> Result<Vec<Bytes>, PageSplitError> {
    let declared: u128 = sizes.iter().map(|&s| u128::from(s)).sum();
    if declared != body.len() as u128 {
        return Err(PageSplitError {
            declared,
            actual: body.len(),
        });
    }
    let mut offset = 0usize;
    Ok(sizes
        .iter()
        .map(|&size| {
            // Cannot overflow: the sum of sizes equals body.len().
            let end = offset + size as usize;
            let page = body.slice(offset..end);
            offset = end;
            page
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_exactly_or_refuses() {
        let body = Bytes::from_static(b"abcdef");
        let pages = split_pages(&body, &[0, 2, 4]).unwrap();
        assert_eq!(
            pages,
            vec![Bytes::new(), Bytes::from("ab"), Bytes::from("cdef")]
        );
        assert_eq!(
            split_pages(&body, &[2, 2]),
            Err(PageSplitError {
                declared: 4,
                actual: 6
            })
        );
        assert!(split_pages(&body, &[u64::MAX, 7]).is_err());
    }
}
