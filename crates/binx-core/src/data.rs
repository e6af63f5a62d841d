//! The one builder of DATA replies. The core decides which pages a reply
//! holds and where each is (memory, an object this daemon wrote, an object a
//! commit marker names) and hands the driver a [`DataPlan`]; the driver only
//! fetches what the plan names (reads objects, presigns URLs) and calls
//! [`DataPlan::assemble`], which lays out the segments and the body. BinX
//! connections, forwarded replies from storage and the HTTP exchange all
//! go through it.

use std::sync::Arc;

use binx_proto::{BinReply, Segment, Spooled, Status, segment};
use bytes::Bytes;

use crate::Reply;
use crate::ids::LeaseId;
use crate::objects::ObjectMeta;
use crate::request::cap_error;
use crate::task_id::TaskId;

/// One page of a reply, as the core placed it.
#[derive(Clone, Debug)]
pub(crate) enum PlannedPage {
    Memory(Bytes),
    /// Page `index` of an object; `whole` when the client may fetch the
    /// object itself (a URL) if the reply covers all of it.
    Object {
        meta: Arc<ObjectMeta>,
        index: u32,
        whole: bool,
    },
}

/// What a reply holds, in token order.
#[derive(Clone, Debug)]
pub enum PlanPart {
    /// Pages in memory.
    Inline {
        /// Token of the first page.
        first_token: u64,
        /// The pages, in token order.
        pages: Vec<Bytes>,
    },
    /// Pages `from .. from + count` of an object, to read (or, when
    /// `may_presign` and the part is the whole object, to hand out as a
    /// URL).
    Object {
        /// Token of the first page read (page `from` of the object).
        first_token: u64,
        /// The segment object.
        object: Arc<ObjectMeta>,
        /// Index of the first page within the object.
        from: u32,
        /// Pages read.
        count: u32,
        /// The client accepts spooled segments, and the store can presign.
        may_presign: bool,
    },
}

/// What the driver found for one `PlanPart::Object`, in order.
#[derive(Clone, Debug)]
pub enum Resolved {
    /// Every page of the object, read and checked.
    Pages(Arc<Vec<Bytes>>),
    /// A URL the client fetches itself.
    Url {
        /// The presigned URL.
        url: String,
        /// When it stops working (unix milliseconds).
        expires_at_unix_ms: u64,
    },
    /// It could not be read: the reply becomes BUSY when `retry` (the store
    /// was unreachable: asking again at the same token is exact), else
    /// SERVER_ERROR (the object is gone or damaged).
    Failed {
        /// What went wrong, for the reply's error text.
        error: String,
        /// The store was unreachable (BUSY) rather than the object bad.
        retry: bool,
    },
    /// It is gone for good, expired by `spool_ttl`: the reply is
    /// SERVER_ERROR even from another node's commit marker (where a
    /// missing object is TIMEOUT, so that the node is asked again): no
    /// node can serve these pages any more.
    Expired {
        /// What is gone and when it expired, for the reply's error text.
        error: String,
    },
}

/// The DATA a plan answers: "DATA for buffer B of task T at token X",
/// written out only when an error shows it (every DATA reply is planned,
/// and formatting its text each time cost a few per cent of a small
/// request's CPU).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanSubject {
    /// The buffer's task.
    pub task: TaskId,
    /// The buffer.
    pub buffer: u64,
    /// The token asked for.
    pub token: u64,
    /// Read from another node's commit marker.
    pub from_storage: bool,
}

impl std::fmt::Display for PlanSubject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DATA for buffer {} of task {} at token {}",
            self.buffer, self.task, self.token
        )?;
        if self.from_storage {
            f.write_str(", from storage")?;
        }
        Ok(())
    }
}

/// A DATA reply whose pages the driver may have to fetch first.
#[derive(Debug)]
pub struct DataPlan {
    /// The reply header, all but its segments.
    pub header: BinReply,
    /// What the reply holds, in token order.
    pub parts: Vec<PlanPart>,
    /// The objects this plan reads stay until [`crate::Core::plan_finished`].
    pub lease: Option<LeaseId>,
    /// The object the buffer's next pages are in, when they are only in
    /// storage: a driver may read it ahead, while this reply is sent. Only a
    /// hint: it is not leased, and the DATA that needs it reads it anyway.
    pub read_ahead: Option<Arc<ObjectMeta>>,
    /// The DATA this plan answers, for errors.
    pub what: PlanSubject,
    /// The status of the reply when an object is missing or damaged:
    /// SERVER_ERROR, but TIMEOUT for a reply from another node's commit
    /// marker (the core then asks that node again, which says why).
    pub(crate) on_lost: Status,
}

impl DataPlan {
    /// A plan for `pages` from the header's `page_token` on.
    pub(crate) fn build(header: BinReply, what: PlanSubject, pages: Vec<PlannedPage>) -> DataPlan {
        let mut parts: Vec<PlanPart> = Vec::new();
        for (token, page) in (header.page_token..).zip(pages) {
            match page {
                PlannedPage::Memory(body) => match parts.last_mut() {
                    Some(PlanPart::Inline { pages, .. }) => pages.push(body),
                    _ => parts.push(PlanPart::Inline {
                        first_token: token,
                        pages: vec![body],
                    }),
                },
                PlannedPage::Object { meta, index, whole } => match parts.last_mut() {
                    Some(PlanPart::Object {
                        object,
                        from,
                        count,
                        ..
                    }) if Arc::ptr_eq(object, &meta) && *from + *count == index => *count += 1,
                    _ => parts.push(PlanPart::Object {
                        first_token: token,
                        object: meta,
                        from: index,
                        count: 1,
                        may_presign: whole,
                    }),
                },
            }
        }
        // Only a part that covers its whole object may go out as a URL.
        for part in &mut parts {
            if let PlanPart::Object {
                object,
                from,
                count,
                may_presign,
                ..
            } = part
            {
                *may_presign &= *from == 0 && *count as usize == object.page_sizes.len();
            }
        }
        DataPlan {
            header,
            parts,
            lease: None,
            read_ahead: None,
            what,
            on_lost: Status::ServerError,
        }
    }

    /// Whether the driver has nothing to fetch.
    pub fn is_ready(&self) -> bool {
        self.parts
            .iter()
            .all(|p| matches!(p, PlanPart::Inline { .. }))
    }

    /// The objects to fetch, in order, and whether each may be a URL.
    pub fn objects(&self) -> impl Iterator<Item = (&Arc<ObjectMeta>, bool)> {
        self.parts.iter().filter_map(|p| match p {
            PlanPart::Object {
                object,
                may_presign,
                ..
            } => Some((object, *may_presign)),
            PlanPart::Inline { .. } => None,
        })
    }

    /// The reply: inline pages as inline segments in the body, URLs as
    /// spooled segments; `resolved` holds one entry per object part, in
    /// order. Anything that does not fit what was planned makes the reply
    /// SERVER_ERROR naming the object: a short reply is never sent.
    pub fn assemble(self, resolved: Vec<Resolved>) -> Reply {
        let mut header = self.header;
        let mut segments: Vec<Segment> = Vec::new();
        let mut body: Vec<Bytes> = Vec::new();
        let mut resolved = resolved.into_iter();
        let fail_as = |header: &BinReply, status: Status, detail: String| {
            let mut failed = BinReply {
                request_id: header.request_id,
                r#type: header.r#type,
                status: status as i32,
                page_token: header.page_token,
                page_next_token: header.page_token,
                ..Default::default()
            };
            failed.error = cap_error(format!("{}: {detail}", self.what));
            Reply::new(failed)
        };
        let on_lost = self.on_lost;
        let fail = |header: &BinReply, detail: String| fail_as(header, on_lost, detail);
        for part in self.parts {
            match part {
                PlanPart::Inline { first_token, pages } => {
                    for (i, page) in pages.into_iter().enumerate() {
                        push_inline(&mut segments, first_token + i as u64, page.len() as u64);
                        body.push(page);
                    }
                }
                PlanPart::Object {
                    first_token,
                    object,
                    from,
                    count,
                    may_presign,
                } => match resolved.next() {
                    Some(Resolved::Url {
                        url,
                        expires_at_unix_ms,
                    }) if may_presign => segments.push(Segment {
                        first_token,
                        page_sizes: object.page_sizes.clone(),
                        body: Some(segment::Body::Spooled(Spooled {
                            uri: url,
                            headers: Default::default(),
                            stored_size: object.stored_size,
                            key: object.key.map(|k| k.to_vec()).unwrap_or_default(),
                            expires_at_unix_ms,
                        })),
                    }),
                    Some(Resolved::Pages(pages)) => {
                        let (from, to) = (from as usize, from as usize + count as usize);
                        let Some(run) = pages.get(from..to) else {
                            return fail(
                                &header,
                                format!(
                                    "spool object {} holds {} pages, fewer than the {to} its pages refer to",
                                    object.name,
                                    pages.len()
                                ),
                            );
                        };
                        for (i, page) in run.iter().enumerate() {
                            let expected = object.page_sizes.get(from + i).copied();
                            if expected != Some(page.len() as u64) {
                                return fail(
                                    &header,
                                    format!(
                                        "spool object {} page {} has {} bytes where {expected:?} were written",
                                        object.name,
                                        from + i,
                                        page.len()
                                    ),
                                );
                            }
                            push_inline(&mut segments, first_token + i as u64, page.len() as u64);
                            body.push(page.clone());
                        }
                    }
                    Some(Resolved::Failed { error, retry: true }) => {
                        return fail_as(
                            &header,
                            Status::Busy,
                            format!("cannot read spooled pages now, retry: {error}"),
                        );
                    }
                    Some(Resolved::Failed { error, .. }) => {
                        return fail(&header, format!("cannot read spooled pages: {error}"));
                    }
                    Some(Resolved::Expired { error }) => {
                        return fail_as(
                            &header,
                            Status::ServerError,
                            format!("cannot read spooled pages: {error}"),
                        );
                    }
                    Some(Resolved::Url { .. }) | None => {
                        return fail(
                            &header,
                            format!("spool object {} was not fetched", object.name),
                        );
                    }
                },
            }
        }
        header.segments = segments;
        Reply { header, body }
    }
}

/// Adds one inline page to the reply, extending the last inline segment.
fn push_inline(segments: &mut Vec<Segment>, token: u64, size: u64) {
    if let Some(last) = segments.last_mut()
        && matches!(last.body, Some(segment::Body::Inline(_)))
        && last.first_token + last.page_sizes.len() as u64 == token
    {
        last.page_sizes.push(size);
        return;
    }
    segments.push(Segment::inline(token, vec![size]));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, sizes: &[u64]) -> Arc<ObjectMeta> {
        Arc::new(ObjectMeta {
            store: 0,
            name: name.into(),
            first_token: 0,
            page_sizes: sizes.to_vec(),
            stored_size: 99,
            codec: Default::default(),
            key: None,
            expires_at_unix_ms: 0,
        })
    }

    fn subject(token: u64) -> PlanSubject {
        PlanSubject {
            task: TaskId::parse("t").expect("task id"),
            buffer: 1,
            token,
            from_storage: false,
        }
    }

    #[test]
    fn a_subject_reads_as_the_data_it_answers() {
        let mut what = subject(7);
        assert_eq!(what.to_string(), "DATA for buffer 1 of task t at token 7");
        what.from_storage = true;
        assert_eq!(
            what.to_string(),
            "DATA for buffer 1 of task t at token 7, from storage"
        );
    }

    fn header(token: u64) -> BinReply {
        BinReply {
            status: Status::Ok as i32,
            page_token: token,
            page_next_token: token + 3,
            ..Default::default()
        }
    }

    #[test]
    fn memory_and_object_pages_become_segments_in_token_order() {
        let object = meta("o", &[2, 3]);
        let plan = DataPlan::build(
            header(10),
            subject(10),
            vec![
                PlannedPage::Memory(Bytes::from_static(b"a")),
                PlannedPage::Object {
                    meta: object.clone(),
                    index: 0,
                    whole: true,
                },
                PlannedPage::Object {
                    meta: object,
                    index: 1,
                    whole: true,
                },
            ],
        );
        assert!(!plan.is_ready());
        assert_eq!(plan.objects().map(|(_, p)| p).collect::<Vec<_>>(), [true]);
        let pages = Arc::new(vec![Bytes::from_static(b"bb"), Bytes::from_static(b"ccc")]);
        let reply = plan.assemble(vec![Resolved::Pages(pages)]);
        assert_eq!(reply.header.status, Status::Ok as i32);
        assert_eq!(reply.header.segments.len(), 1);
        assert_eq!(reply.header.segments[0].page_sizes, vec![1, 2, 3]);
        assert_eq!(reply.body.concat(), b"abbccc");
    }

    #[test]
    fn a_part_of_an_object_is_never_a_url_and_a_short_object_is_an_error() {
        let object = meta("o", &[2, 3]);
        let plan = DataPlan::build(
            header(0),
            subject(0),
            vec![PlannedPage::Object {
                meta: object,
                index: 1,
                whole: true,
            }],
        );
        assert_eq!(plan.objects().map(|(_, p)| p).collect::<Vec<_>>(), [false]);
        let reply = plan.assemble(vec![Resolved::Pages(Arc::new(vec![Bytes::new()]))]);
        assert_eq!(reply.header.status, Status::ServerError as i32);
        assert!(
            reply
                .header
                .error
                .starts_with("DATA for buffer 1 of task t at token 0: "),
            "{}",
            reply.header.error
        );
        assert!(reply.body.is_empty());
    }

    /// From another node's marker a missing object is TIMEOUT (that node is
    /// asked again) and an unreachable store BUSY; an object expired by
    /// `spool_ttl` is SERVER_ERROR: nothing brings it back.
    #[test]
    fn an_expired_object_is_a_server_error_even_from_another_nodes_marker() {
        let plan = || {
            let mut plan = DataPlan::build(
                header(4),
                subject(4),
                vec![PlannedPage::Object {
                    meta: meta("o", &[2]),
                    index: 0,
                    whole: true,
                }],
            );
            plan.on_lost = Status::Timeout;
            plan
        };
        let status = |resolved: Resolved| {
            let reply = plan().assemble(vec![resolved]);
            assert!(reply.body.is_empty());
            (reply.header.status, reply.header.error)
        };
        let failed = |retry| Resolved::Failed {
            error: "not found".into(),
            retry,
        };
        assert_eq!(status(failed(false)).0, Status::Timeout as i32);
        assert_eq!(status(failed(true)).0, Status::Busy as i32);
        let (code, error) = status(Resolved::Expired {
            error: "spool object o is gone: it expired".into(),
        });
        assert_eq!(code, Status::ServerError as i32);
        assert_eq!(
            error,
            "DATA for buffer 1 of task t at token 4: cannot read spooled pages: spool object o is gone: it expired"
        );
    }
}
