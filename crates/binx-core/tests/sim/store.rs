//! The object store and the other work a core asks for: segment and
//! marker writes, reads, deletes, manifests and forwarded requests, each
//! done (or failed) after a drawn latency.

use super::*;

impl World {
    pub(super) fn command(&mut self, side: usize, life: u32, op: OpId, command: Command) -> Check {
        let delay = self.store_latency();
        let fails = self.rng.f64() < self.params.store_fail;
        let node = self.sides[side].node.clone();
        match command {
            Command::WriteSegment {
                task,
                first_token,
                pages,
                durability,
                ..
            } => {
                let done = if fails {
                    // Sometimes the object lands although the writer hears
                    // of a failure (a timeout after the write).
                    if self.rng.bool() {
                        self.store.serial += 1;
                        let name = format!("{node}-l{life}-{}-orphan", self.store.serial);
                        self.store.objects.insert(
                            name,
                            StoredObject {
                                pages: pages.clone(),
                                node: node.clone(),
                                side,
                                life,
                                durability,
                            },
                        );
                    }
                    Completion::SegmentWritten(Err(StoreFailure::transient(
                        "the store is unreachable",
                    )))
                } else {
                    self.store.serial += 1;
                    let letter = match durability {
                        Durability::Overflow => "o",
                        Durability::Durable => "a",
                    };
                    let name = format!("{node}-l{life}-{}-{letter}-{task}", self.store.serial);
                    let meta = segment_meta(name.clone(), first_token, &pages);
                    self.store.objects.insert(
                        name,
                        StoredObject {
                            pages,
                            node: node.clone(),
                            side,
                            life,
                            durability,
                        },
                    );
                    Completion::SegmentWritten(Ok(meta))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::WriteMarker(plan) => {
                let done = if fails {
                    Completion::MarkerWritten(Err(StoreFailure::transient(
                        "the store is unreachable",
                    )))
                } else {
                    for o in &plan.objects {
                        if !self.store.objects.contains_key(&o.name) {
                            return Err(format!(
                                "sidecar {side} commits buffer {} of task {} naming object {}, which is not in storage",
                                plan.buffer, plan.task, o.name
                            ));
                        }
                    }
                    self.store.markers.insert(
                        (plan.task.to_string(), plan.buffer),
                        written_marker(
                            &plan,
                            (
                                &node,
                                &self.sides[side].addr,
                                Some(&format!("{side}.{life}")),
                            ),
                            false,
                        ),
                    );
                    Completion::MarkerWritten(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::DeleteObject(meta) => {
                let done = if self.rng.f64() < self.params.delete_fail {
                    self.store.failed_deletes += 1;
                    Completion::ObjectDeleted(Err(StoreFailure::transient(
                        "the store is unreachable",
                    )))
                } else {
                    if let Some((task, buffer)) = self.store.named_by_marker(&meta.name) {
                        return Err(format!(
                            "sidecar {side} deletes object {} while the commit marker of buffer {buffer} of task {task} names it",
                            meta.name
                        ));
                    }
                    self.store.objects.remove(&meta.name);
                    Completion::ObjectDeleted(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::DeleteMarker { task, buffer } => {
                let done = if self.rng.f64() < self.params.delete_fail {
                    Completion::MarkerDeleted(Err(StoreFailure::transient(
                        "the store is unreachable",
                    )))
                } else {
                    self.store.markers.remove(&(task.to_string(), buffer));
                    Completion::MarkerDeleted(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::ReadMarker { task, buffer } => {
                let done = if fails {
                    Completion::MarkerRead(Err(StoreFailure::transient("the store is unreachable")))
                } else {
                    let marker = self.store.marker(task.as_str(), buffer);
                    if marker.as_ref().is_some_and(|m| m.folded) {
                        self.store.folded_read += 1;
                    }
                    Completion::MarkerRead(Ok(marker))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::WriteManifest(plan) => {
                let done = if fails {
                    Completion::ManifestWritten(Err(StoreFailure::transient(
                        "the store is unreachable",
                    )))
                } else {
                    self.check_manifest(side, &plan)?;
                    // A put replaces the manifest: what an earlier one of
                    // the task folded in is gone (its release records stay).
                    let task = plan.task.to_string();
                    self.store.folded.retain(|(t, _), _| *t != task);
                    for m in &plan.markers {
                        self.store.folded.insert(
                            (plan.task.to_string(), m.buffer),
                            written_marker(
                                m,
                                (
                                    &node,
                                    &self.sides[side].addr,
                                    Some(&format!("{side}.{life}")),
                                ),
                                true,
                            ),
                        );
                    }
                    self.store
                        .manifests
                        .insert(plan.task.to_string(), (side, life, plan));
                    Completion::ManifestWritten(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::ReadManifest { task } => {
                // Nothing in the simulation asks COMMITTED (the core's
                // tests and the Java plugin's do); answered all the same.
                let result = if fails {
                    Err(binx_core::ManifestError::Unavailable(
                        "the store is unreachable".into(),
                    ))
                } else {
                    Ok(self.store.manifests.get(task.as_str()).map(|(s, _, plan)| {
                        binx_core::Manifest {
                            node: self.sides[*s].node.clone(),
                            endpoint: self.sides[*s].addr.clone(),
                            buffers: plan.buffers.clone(),
                        }
                    }))
                };
                let now = self.instant();
                if let Some(core) = self.sides[side].core.as_mut() {
                    core.complete(op, now, |core, op| core.manifest_read(op, result, now));
                }
            }
            Command::DeleteManifest { task, .. } => {
                let done = if self.rng.f64() < self.params.delete_fail {
                    self.store.failed_deletes += 1;
                    Completion::ManifestDeleted(Err(StoreFailure::transient(
                        "the store is unreachable",
                    )))
                } else {
                    self.store.remove_manifest(task.as_str());
                    Completion::ManifestDeleted(Ok(()))
                };
                self.store_done(delay, side, life, op, done);
            }
            Command::ReleaseCommitted(marker) => {
                // Released only for its consumer's DELETE (through failover,
                // or at a sidecar that forgot the task): never while a
                // consumer may still read it.
                if !self
                    .store
                    .deleted_by_consumers
                    .contains(&(marker.task_id.clone(), marker.buffer_id))
                {
                    return Err(format!(
                        "sidecar {side} releases committed buffer {} of task {}, which no consumer deleted",
                        marker.buffer_id, marker.task_id
                    ));
                }
                // As binx-spool does: the marker (a folded one: a record of
                // its release), then the segments no
                // other marker of the task lists (BROADCAST buffers share
                // segments: the last marker to go takes them), shared ones
                // only once the task's manifest exists (before that, a
                // producer that is only cut off may still serve them or
                // list them in markers it has yet to write); the last
                // marker to go takes the manifest.
                let key = (marker.task_id.clone(), marker.buffer_id);
                if marker.folded {
                    self.store.folded_released += 1;
                    self.store.released.insert(key);
                } else {
                    self.store.markers.remove(&key);
                }
                let has_manifest = self.store.manifests.contains_key(marker.task_id.as_str());
                if has_manifest && !self.store.markers_left(&marker.task_id) {
                    self.store.remove_manifest(&marker.task_id);
                }
                let segments: &[_] = if marker.shared && !has_manifest {
                    &[]
                } else {
                    &marker.segments
                };
                for segment in segments {
                    match self.store.named_by_marker(&segment.name) {
                        // Another marker of the task lists it: it stays.
                        Some((task, _)) if *task == marker.task_id => {}
                        Some(key) => {
                            return Err(format!(
                                "releasing a committed buffer deletes {} which marker {key:?} names",
                                segment.name
                            ));
                        }
                        None => {
                            self.store.objects.remove(&segment.name);
                        }
                    }
                }
                self.store_done(delay, side, life, op, Completion::Released);
            }
            Command::Forward {
                remote,
                request,
                instance,
            } => {
                let target = self.sides.iter().position(|s| s.addr == remote);
                let reachable = target.is_some_and(|t| {
                    self.sides[t].core.is_some()
                        && !self.partitioned(side, t)
                        && self.rng.f64() >= self.params.drop_forward
                });
                // As binxd's forwarder: a connection whose HELLO names
                // another process than the one asked for sends nothing.
                let answering = target.map(|t| self.instance_of(t));
                match target {
                    Some(t)
                        if reachable
                            && instance
                                .as_ref()
                                .is_some_and(|i| Some(i) != answering.as_ref()) =>
                    {
                        let delay = self.latency();
                        let from = (
                            self.sides[t].addr.clone(),
                            self.sides[t].node.clone(),
                            answering.unwrap_or_else(|| Arc::from("?")),
                        );
                        self.after(
                            delay,
                            Ev::Withheld {
                                side,
                                life,
                                op,
                                from,
                            },
                        );
                    }
                    Some(t) if reachable => {
                        let delay = self.latency();
                        let tlife = self.sides[t].life;
                        self.after(
                            delay,
                            Ev::Request {
                                side: t,
                                life: tlife,
                                conn: ConnId(1_000_000 + side as u64),
                                waiter: Waiter::Remote {
                                    from: side,
                                    life,
                                    op,
                                },
                                raw: request,
                                body: Bytes::new(),
                                door: Door::Remote,
                            },
                        );
                    }
                    _ => {
                        let delay = Duration::from_millis(self.rng.u64(10..5_000));
                        self.after(
                            delay,
                            Ev::Forwarded {
                                side,
                                life,
                                op,
                                result: Err(format!("cannot connect to {remote}")),
                            },
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads what a DATA plan names from the store and assembles the reply,
    /// as binx-server's driver does.
    pub(super) fn carry_out(&mut self, side: usize, plan: DataPlan) -> Result<Reply, String> {
        let read: Vec<u64> = plan.objects().map(|(m, _)| m.page_bytes()).collect();
        if read.len() > 1 && read.iter().sum::<u64>() > MAX_STORED_REPLY {
            return Err(format!(
                "sidecar {side} planned to read back objects of {read:?} bytes ({}), more than {MAX_STORED_REPLY}",
                plan.what
            ));
        }
        let mut resolved = Vec::new();
        for (meta, may_presign) in plan.objects() {
            if may_presign && self.rng.bool() {
                resolved.push(Resolved::Url {
                    url: format!("sim://{}", meta.name),
                    expires_at_unix_ms: 1,
                });
                continue;
            }
            let transient = self.rng.f64() < self.params.store_fail;
            resolved.push(match self.store.objects.get(&meta.name) {
                _ if transient => Resolved::Failed {
                    error: "the store is unreachable".into(),
                    retry: true,
                },
                Some(o) => Resolved::Pages(Arc::new(o.pages.clone())),
                None => Resolved::Failed {
                    error: format!("{} does not exist", meta.name),
                    retry: false,
                },
            });
        }
        let lease = plan.lease;
        let what = plan.what.clone();
        let reply = plan.assemble(resolved);
        let status = reply.header.status_kind();
        if status == Status::ServerError {
            return Err(format!(
                "sidecar {side} could not read pages it planned ({what}): {}",
                reply.header.error
            ));
        }
        let now = self.instant();
        if let Some(core) = self.sides[side].core.as_mut() {
            core.plan_finished(lease, status, now);
        }
        Ok(reply)
    }
}
