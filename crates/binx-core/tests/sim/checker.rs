//! The checker: the invariants every run keeps (exactness of every page
//! a consumer reads, prefixes of what producers sent, manifests, the
//! cores' own invariants), checked as events happen and at the end.

use super::*;

impl World {
    pub(super) fn check_cores(&mut self) -> Check {
        for (i, side) in self.sides.iter().enumerate() {
            if let Some(core) = &side.core {
                core.check_invariants()
                    .map_err(|e| format!("sidecar {i}: {e}"))?;
            }
        }
        // A NO_MORE_PAGES takes effect when its task's input is finished,
        // which may be before its reply (under `always` the reply waits for
        // the commit markers, and may even be BUSY).
        for p in 0..self.producers.len() {
            let pr = &self.producers[p];
            if !pr.nmp_sent || pr.nmp_applied {
                continue;
            }
            let Some(core) = &self.sides[pr.side].core else {
                continue;
            };
            let finished = core
                .task_snapshots(&pr.task_id, self.base + self.now)
                .iter()
                .any(|t| t.task_id == pr.task_id && t.input_finished);
            if finished {
                self.nmp_took_effect(p)?;
            }
        }
        // A buffer its consumer deleted (even before the task opened) holds
        // no page: the producer's pages for it are dropped on arrival.
        // (Only for consumers on the producer's own sidecar: a proxy consumer
        // whose producer is unreachable deletes from storage, and the
        // producer drops the buffer when it is abandoned.)
        for c in self.consumers.iter().filter(|c| c.deleted) {
            let pr = &self.producers[c.task];
            if pr.kind != BufferKind::Partitioned
                || self.sides[pr.side].life > 0
                || c.side != pr.side
            {
                continue;
            }
            let Some(core) = &self.sides[pr.side].core else {
                continue;
            };
            for task in core.task_snapshots(&pr.task_id, self.base + self.now) {
                if task.task_id != pr.task_id {
                    continue;
                }
                if let Some(b) = task.buffers.iter().find(|b| b.buffer_id == c.buffer)
                    && b.pages_held > 0
                {
                    return Err(format!(
                        "buffer {} of task {} was deleted by its consumer, yet holds {} pages",
                        c.buffer, pr.task_id, b.pages_held
                    ));
                }
            }
        }
        Ok(())
    }

    /// What the core answered an ENQUEUE or NO_MORE_PAGES of a producer
    /// (whether or not the producer still waits for it): OK means it took
    /// effect.
    pub(super) fn mutation_done(&mut self, side: usize, ticket: Ticket, status: Status) -> Check {
        let Some((p, _, what)) = self.sides[side].mutations.remove(&ticket) else {
            return Ok(());
        };
        self.mutation_answered(p, what, status)
    }

    pub(super) fn mutation_answered(
        &mut self,
        p: usize,
        what: ProducerReq,
        status: Status,
    ) -> Check {
        if status != Status::Ok {
            return Ok(());
        }
        match what {
            ProducerReq::Batch(i) => {
                // An OK that dropped the pages (their consumer deleted the
                // buffer, or every consumer went) says nothing of order.
                let buffer = self.producers[p].batches[i].buffer;
                if self.drops_pages(p, buffer) {
                    self.producers[p].applied[i] = true;
                    return Ok(());
                }
                let pr = &mut self.producers[p];
                let has_pages = |j: usize| !pr.batches[j].sizes.is_empty();
                let key =
                    |j: usize| (pr.kind == BufferKind::Partitioned).then_some(pr.batches[j].buffer);
                if has_pages(i) && pr.applied[i] {
                    return Err(format!(
                        "producer {p}: ENQUEUE {i} of task {} took effect twice",
                        pr.task_id
                    ));
                }
                // Its buffer holds every page before it: each page at the
                // token its producer meant.
                let missing: Vec<usize> = (0..i)
                    .filter(|&j| key(j) == key(i) && has_pages(j) && !pr.applied[j])
                    .collect();
                if has_pages(i) && !missing.is_empty() {
                    return Err(format!(
                        "producer {p}: ENQUEUE {i} of task {} took effect before ENQUEUEs {missing:?} of the same buffer (numbered: {}, states {:?})",
                        pr.task_id, pr.numbered, pr.states
                    ));
                }
                pr.applied[i] = true;
                Ok(())
            }
            ProducerReq::NoMorePages if !self.producers[p].nmp_applied => self.nmp_took_effect(p),
            _ => Ok(()),
        }
    }

    /// Whether producer `p`'s sidecar drops pages enqueued to `buffer` now
    /// (its consumer deleted or abandoned it, or the task ended).
    pub(super) fn drops_pages(&self, p: usize, buffer: u64) -> bool {
        let pr = &self.producers[p];
        let Some(core) = &self.sides[pr.side].core else {
            return true;
        };
        let tasks = core.task_snapshots(&pr.task_id, self.base + self.now);
        let Some(task) = tasks.iter().find(|t| t.task_id == pr.task_id) else {
            return true;
        };
        let gone = |b: &binx_core::BufferSnapshot| {
            matches!(b.state, BufferState::Deleted | BufferState::Abandoned)
        };
        if pr.kind == BufferKind::Partitioned {
            // A buffer deleted before its first page never shows.
            return task
                .buffers
                .iter()
                .find(|b| b.buffer_id == buffer)
                .is_none_or(gone);
        }
        // A shared log's pages go nowhere once every buffer of a fixed
        // count is gone (its consumers deleted them: the task is over).
        task.buffer_count
            .is_some_and(|count| task.buffers.len() as u64 == count)
            && task.buffers.iter().all(gone)
    }

    /// A producer's NO_MORE_PAGES took effect: so did every ENQUEUE it sent
    /// before it (whatever took effect is a prefix of what a connection
    /// sent, and a producer sends NO_MORE_PAGES only after all its
    /// ENQUEUEs, on the same connection or after their OK).
    pub(super) fn nmp_took_effect(&mut self, p: usize) -> Check {
        // An ENQUEUE whose pages would be dropped now (its buffer, or every
        // buffer, deleted by consumers) loses nothing by not taking effect.
        let missing: Vec<usize> = (0..self.producers[p].batches.len())
            .filter(|&i| {
                let pr = &self.producers[p];
                !pr.applied[i] && !self.drops_pages(p, pr.batches[i].buffer)
            })
            .collect();
        let pr = &mut self.producers[p];
        pr.nmp_applied = true;
        if !missing.is_empty() {
            return Err(format!(
                "producer {p}: the NO_MORE_PAGES of task {} took effect, but ENQUEUEs {missing:?} it sent before it did not (states {:?})",
                pr.task_id, pr.states
            ));
        }
        Ok(())
    }

    /// A commit manifest says, of every buffer still committed, exactly
    /// where its producer ended it and how many bytes it made for it: a
    /// coordinator sizes tasks and checks reads by it.
    pub(super) fn check_manifest(&self, side: usize, plan: &ManifestPlan) -> Check {
        let Some(p) = self
            .producers
            .iter()
            .position(|pr| pr.task_id == plan.task.as_str())
        else {
            return Err(format!(
                "sidecar {side} writes a manifest of unknown task {}",
                plan.task
            ));
        };
        let pr = &self.producers[p];
        for m in &plan.markers {
            // A folded marker says what a marker of its own would: where
            // the buffer ends (as the manifest does), and objects that are
            // in storage.
            if plan.buffers.get(m.buffer as usize).map(|&(end, _)| end) != Some(m.end_token) {
                return Err(format!(
                    "sidecar {side} folds the marker of buffer {} of task {} ending at {} into a manifest that says {:?}",
                    m.buffer,
                    plan.task,
                    m.end_token,
                    plan.buffers.get(m.buffer as usize)
                ));
            }
            if let Some(o) = m
                .objects
                .iter()
                .find(|o| !self.store.objects.contains_key(&o.name))
            {
                return Err(format!(
                    "sidecar {side} commits buffer {} of task {} in its manifest naming object {}, which is not in storage",
                    m.buffer, plan.task, o.name
                ));
            }
        }
        for (b, &(end, bytes)) in plan.buffers.iter().enumerate() {
            let b = b as u64;
            let committed = self.store.markers.contains_key(&(pr.task_id.clone(), b))
                || plan.markers.iter().any(|m| m.buffer == b);
            if !committed {
                // Deleted or dropped since: nobody reads it by the manifest.
                continue;
            }
            let mine = |batch: &&Batch| pr.kind != BufferKind::Partitioned || batch.buffer == b;
            let pages: u64 = pr
                .batches
                .iter()
                .filter(mine)
                .map(|x| x.sizes.len() as u64)
                .sum();
            let made: u64 = pr
                .batches
                .iter()
                .filter(mine)
                .flat_map(|x| x.sizes.iter())
                .map(|&size| size as u64)
                .sum();
            if (end, bytes) != (pages, made) {
                return Err(format!(
                    "the manifest of task {} says buffer {b} ends at {end} with {bytes} bytes; its producer made {pages} pages of {made} bytes",
                    pr.task_id
                ));
            }
        }
        Ok(())
    }

    /// A page received at `token` must be exactly the page produced there.
    pub(super) fn check_page(&mut self, c: usize, token: u64, data: &Bytes) -> Check {
        let cs = &self.consumers[c];
        // Every page once, in token order: nothing skipped, nothing twice.
        if token != cs.pages {
            return Err(format!(
                "consumer {c} of buffer {} got page {token} after {} pages",
                cs.buffer, cs.pages
            ));
        }
        let producer = &self.producers[cs.task];
        let (task, kind) = (producer.task, producer.kind);
        let expected_buffer = if kind == BufferKind::Partitioned {
            cs.buffer as u32
        } else {
            u32::MAX
        };
        if data.len() >= 16 {
            let t = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize;
            let b = u32::from_be_bytes([data[4], data[5], data[6], data[7]]);
            let seq = u64::from_be_bytes(data[8..16].try_into().unwrap_or_default());
            if t != task || b != expected_buffer {
                return Err(format!(
                    "consumer {c} of buffer {} got page {token} of task {t} buffer {b}",
                    cs.buffer
                ));
            }
            match kind {
                BufferKind::Arbitrary
                    if !self.arbitrary_seen.entry(cs.task).or_default().insert(seq) =>
                {
                    return Err(format!(
                        "page {seq} of arbitrary task {task} was handed out twice"
                    ));
                }
                BufferKind::Arbitrary => {}
                _ if seq != token => {
                    let wrong = format!(
                        "consumer {c} of buffer {} got page {seq} at token {token}",
                        cs.buffer
                    );
                    self.consumers[c].suspect.get_or_insert(wrong);
                }
                _ => {}
            }
        } else if kind != BufferKind::Arbitrary {
            // Small pages: their size and fill must match what was produced at `token`.
            let expected = self.produced_size(cs.task, cs.buffer, token);
            if expected != Some(data.len()) || data.iter().any(|&x| x != (token % 251) as u8) {
                let wrong = format!(
                    "consumer {c} of buffer {} got a {}-byte page at token {token}, where {expected:?} bytes were produced",
                    cs.buffer,
                    data.len()
                );
                self.consumers[c].suspect.get_or_insert(wrong);
            }
        }
        let cs = &mut self.consumers[c];
        cs.held += data.len() as u64;
        cs.pages += 1;
        Ok(())
    }

    pub(super) fn produced_size(&self, p: usize, buffer: u64, token: u64) -> Option<usize> {
        let pr = &self.producers[p];
        pr.batches
            .iter()
            .filter(|b| pr.kind != BufferKind::Partitioned || b.buffer == buffer)
            .find(|b| (b.first_seq..b.first_seq + b.sizes.len() as u64).contains(&token))
            .map(|b| b.sizes[(token - b.first_seq) as usize])
    }

    /// A buffer reads as complete only with every page its producer
    /// finished it with.
    pub(super) fn check_complete(&self, c: usize) -> Check {
        let cs = &self.consumers[c];
        let pr = &self.producers[cs.task];
        if let Some(wrong) = &cs.suspect {
            return Err(format!("a buffer read as complete, but {wrong}"));
        }
        if !pr.nmp_sent || !pr.nmp_applied {
            return Err(format!(
                "buffer {} of task {} read as complete at token {}, but no NO_MORE_PAGES of its producer took effect (sent: {})",
                cs.buffer,
                pr.task_id,
                cs.machine.token(),
                pr.nmp_sent
            ));
        }
        // Every ENQUEUE sent before NO_MORE_PAGES (all of them) took effect.
        let missing: Vec<usize> = (0..pr.batches.len())
            .filter(|&i| {
                !pr.applied[i]
                    && (pr.kind != BufferKind::Partitioned || pr.batches[i].buffer == cs.buffer)
            })
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "buffer {} of task {} read as complete at token {}, but ENQUEUEs {missing:?} its producer sent before NO_MORE_PAGES never took effect",
                cs.buffer,
                pr.task_id,
                cs.machine.token()
            ));
        }
        if pr.kind == BufferKind::Arbitrary {
            return Ok(());
        }
        let key = if pr.kind == BufferKind::Partitioned {
            cs.buffer
        } else {
            u64::MAX
        };
        let expected = pr.final_counts.get(&key).copied().unwrap_or(0);
        if cs.machine.token() != expected {
            return Err(format!(
                "buffer {} of task {} read as complete with {} pages; its producer made {expected}",
                cs.buffer,
                pr.task_id,
                cs.machine.token()
            ));
        }
        Ok(())
    }

    /// At the end: every consumer finished, failed with a reason, or is
    /// waiting on a producer that went; storage holds nothing a live
    /// sidecar no longer needs.
    pub(super) fn check_end(&mut self) -> Check {
        for (c, cs) in self.consumers.iter().enumerate() {
            let pr = &self.producers[cs.task];
            if let Some(wrong) = &cs.suspect {
                return Err(wrong.clone());
            }
            match &cs.state {
                ConsumerState::Done if !cs.completed => {
                    return Err(format!(
                        "consumer {c} deleted its buffer without completing it"
                    ));
                }
                ConsumerState::Waiting | ConsumerState::Running => {
                    // Waiting forever is allowed only when the producer's
                    // sidecar no longer knows the task (it went without
                    // committing, or ended and was forgotten): as for a
                    // consumer that starts before its producer, the engine
                    // decides how long to wait.
                    let known = self.sides[pr.side].core.as_ref().is_some_and(|core| {
                        !core
                            .task_snapshots(&pr.task_id, self.base + self.now)
                            .is_empty()
                    });
                    if known && !pr.aborted {
                        return Err(format!(
                            "consumer {c} of buffer {} of task {} never finished ({:?}), though its producer lives",
                            cs.buffer, pr.task_id, cs.state
                        ));
                    }
                }
                _ => {}
            }
            if pr.kind == BufferKind::Arbitrary && pr.nmp_ok && !pr.aborted {
                // Checked below over all consumers.
            }
        }
        // Live sidecars hold nothing once every task ended; storage holds
        // nothing of theirs but what a failed deletion left to the TTL.
        for (i, side) in self.sides.iter().enumerate() {
            let Some(core) = &side.core else { continue };
            let stats = core.stats();
            if stats.tasks > 0 || stats.memory_used > 0 {
                let waiting = self.consumers.iter().any(|c| {
                    c.side == i
                        && matches!(c.state, ConsumerState::Waiting | ConsumerState::Running)
                });
                if !waiting {
                    return Err(format!(
                        "sidecar {i} still holds {} tasks and {} bytes at the end",
                        stats.tasks, stats.memory_used
                    ));
                }
            }
            let ttl = stats.deletes_left_to_ttl > 0 || self.store.failed_deletes > 0;
            let leaked: Vec<&String> = self
                .store
                .objects
                .iter()
                .filter(|(name, o)| {
                    o.side == i && o.life == side.life && !name.ends_with("-orphan")
                })
                .map(|(n, _)| n)
                .collect();
            let busy = stats.tasks > 0 || stats.requests_waiting > 0;
            if !leaked.is_empty() && !ttl && !busy {
                return Err(format!(
                    "sidecar {i} left objects in storage after every task ended: {leaked:?}"
                ));
            }
            let manifests: Vec<&String> = self
                .store
                .manifests
                .iter()
                .filter(|(_, (s, l, _))| *s == i && *l == side.life)
                .map(|(task, _)| task)
                .collect();
            if !manifests.is_empty() && !ttl && !busy {
                return Err(format!(
                    "sidecar {i} left commit manifests in storage after every task ended: {manifests:?}"
                ));
            }
        }
        // Arbitrary: when every consumer completed, together they got every page.
        for (pid, pr) in self.producers.iter().enumerate() {
            if pr.kind != BufferKind::Arbitrary {
                continue;
            }
            let all_done = self
                .consumers
                .iter()
                .filter(|c| c.task == pid && !c.hostile)
                .all(|c| c.completed);
            if all_done && pr.nmp_sent {
                let total: u64 = pr.final_counts.values().sum();
                let seen = self.arbitrary_seen.get(&pid).map_or(0, |s| s.len() as u64);
                let small: u64 = pr
                    .batches
                    .iter()
                    .flat_map(|b| b.sizes.iter())
                    .filter(|&&s| s < 16)
                    .count() as u64;
                if seen + small < total {
                    return Err(format!(
                        "arbitrary task {} completed everywhere with {seen} of {total} pages (and {small} too small to name)",
                        pr.task_id
                    ));
                }
            }
        }
        Ok(())
    }
}
