//! Task ids, validated once at the door: everything past it holds a
//! [`TaskId`] and never re-checks a string.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

/// Longest task id accepted.
pub const MAX_TASK_ID_LEN: usize = 256;

/// A task id that is safe in logs and storage keys: 1 to 256 characters of
/// `A-Z a-z 0-9 . _ - :`, and neither `.` nor `..` (object stores refuse
/// those as path segments). Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId(Arc<str>);

/// Why a string is not a task id; the text never echoes more than 64 bytes
/// of the hostile value.
pub fn validate_task_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("task_id is empty".into());
    }
    if id.len() > MAX_TASK_ID_LEN {
        return Err(format!(
            "task_id is {} bytes long; the limit is {MAX_TASK_ID_LEN}",
            id.len()
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':')))
    {
        return Err(format!(
            "task_id {:?} contains {c:?}; allowed are A-Z, a-z, 0-9, '.', '_', '-' and ':'",
            binx_proto::truncate(id, 64)
        ));
    }
    if id == "." || id == ".." {
        return Err(format!(
            "task_id {id:?} is not allowed: it is a path segment every object store refuses"
        ));
    }
    Ok(())
}

impl TaskId {
    /// A validated task id, or the sentence that says why not.
    pub fn parse(id: &str) -> Result<TaskId, String> {
        validate_task_id(id)?;
        Ok(TaskId(Arc::from(id)))
    }

    /// The id as the client sent it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for TaskId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for TaskId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_once_with_a_reason() {
        assert!(TaskId::parse("q1.s2:t3_a-b").is_ok());
        assert!(TaskId::parse("...").is_ok());
        for bad in ["", ".", "..", "a/b", "a b", "é"] {
            assert!(TaskId::parse(bad).is_err(), "{bad:?}");
        }
        assert!(TaskId::parse(&"x".repeat(256)).is_ok());
        let long = TaskId::parse(&"x".repeat(257)).unwrap_err();
        assert!(long.contains("257"), "{long}");
        let hostile = format!("{}/", "y".repeat(100_000));
        assert!(validate_task_id(&hostile).unwrap_err().len() < 200);
    }
}
