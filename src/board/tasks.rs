//! Task transitions that do not involve a run: create, link, comment, unblock, archive, promote.

use rusqlite::{OptionalExtension, params};
use serde_json::json;

use super::types::{ClosedRun, Created, Millis, NewTask, RunOutcome, TaskId, TaskStatus};
use super::{BoardError, Result, Tx, changed_one};

/// The longest max runtime a task may ask for: 100 years, as for durations in the config.
pub const MAX_RUNTIME_MS: i64 = 100 * 31_557_600 * 1000;
/// The longest idempotency key and assignee name, in bytes. Both are names, and both ride on
/// every reply that carries the task: unbounded, a client could make every such reply (and a
/// task list, which bounds the texts it returns) as large as a request.
pub const MAX_NAME_BYTES: usize = 256;
/// The longest title, in bytes. A title rides in its workers' environment
/// (`RUNWARDEN_TASK_TITLE`), where the kernel takes no string over 128 KiB: a longer one would
/// make every start fail (`E2BIG`).
pub const MAX_TITLE_BYTES: usize = 64 * 1024;

impl NewTask {
    /// Its names (`idempotency_key`, `assignee`) within [`MAX_NAME_BYTES`], and a key not
    /// empty (one empty key would make every keyless-looking add the same task). The error
    /// names the field, and quotes no name: it could be a megabyte.
    pub fn check_names(&self) -> std::result::Result<(), String> {
        for (what, name) in [
            ("idempotency_key", &self.idempotency_key),
            ("assignee", &self.assignee),
        ] {
            if let Some(name) = name
                && name.len() > MAX_NAME_BYTES
            {
                return Err(format!(
                    "{what} must be at most {MAX_NAME_BYTES} bytes, not {}",
                    name.len()
                ));
            }
        }
        if self.idempotency_key.as_deref() == Some("") {
            return Err("idempotency_key must not be empty (leave it out for none)".into());
        }
        Ok(())
    }
}

impl Tx<'_> {
    /// Creates a task: `ready`, or `todo` while any parent is unfinished. With an idempotency key
    /// that already names an open task, returns that task (`existed: true`) and writes nothing.
    pub fn create_task(&self, new: &NewTask, now: Millis) -> Result<Created> {
        if new.title.trim().is_empty() {
            return Err(BoardError::Invalid("title must not be empty".into()));
        }

        // Out of range, they would silently mean something else (a negative runtime the
        // assignee's; negative retries giving up at the first failure).
        if let Some(ms) = new.max_runtime_ms
            && !(0..=MAX_RUNTIME_MS).contains(&ms)
        {
            return Err(BoardError::Invalid(format!(
                "max_runtime_ms must be between 0 (no limit) and {MAX_RUNTIME_MS} (100 years), not {ms}"
            )));
        }
        if let Some(n) = new.max_retries
            && n < 0
        {
            return Err(BoardError::Invalid(format!(
                "max_retries must not be negative, not {n}"
            )));
        }
        new.check_names().map_err(BoardError::Invalid)?;
        if let Some(key) = &new.idempotency_key {
            let existing: Option<TaskId> = self
                .conn
                .prepare_cached(
                    "SELECT id FROM tasks WHERE idempotency_key = ?1 \
                     AND status NOT IN ('done', 'archived')",
                )?
                .query_row([key], |r| r.get(0))
                .optional()?;
            if let Some(id) = existing {
                return Ok(Created { id, existed: true });
            }
        }
        // After the key's lookup: a retry of an add made before titles were bounded still
        // finds its task.
        if new.title.len() > MAX_TITLE_BYTES {
            return Err(BoardError::Invalid(format!(
                "title must be at most {MAX_TITLE_BYTES} bytes (it is its workers' RUNWARDEN_TASK_TITLE), not {}; put the rest in the body",
                new.title.len()
            )));
        }
        if new.title.contains('\0') {
            return Err(BoardError::Invalid(
                "title must not contain a NUL character (it is its workers' RUNWARDEN_TASK_TITLE)"
                    .into(),
            ));
        }
        // A parent named twice is one link (and said once in the `created` event).
        let mut parents = new.parents.clone();
        let mut seen = std::collections::HashSet::new();
        parents.retain(|p| seen.insert(*p));
        let mut waiting = false;
        for &parent in &parents {
            let status = self.task_status(parent)?;
            waiting |= !status.satisfies_dependency();
        }
        let status = if waiting {
            TaskStatus::Todo
        } else {
            TaskStatus::Ready
        };
        self.conn
            .prepare_cached(
                "INSERT INTO tasks (title, body, assignee, status, priority, created_at, updated_at, \
                 idempotency_key, max_runtime_ms, max_retries) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7, ?8, ?9)",
            )?
            .execute(params![
                new.title,
                new.body,
                new.assignee,
                status.as_str(),
                new.priority,
                now,
                new.idempotency_key,
                new.max_runtime_ms,
                new.max_retries,
            ])?;
        let id = self.conn.last_insert_rowid();
        for &parent in &parents {
            self.conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO task_links (parent_id, child_id) VALUES (?1, ?2)",
                )?
                .execute(params![parent, id])?;
        }
        self.append_event(
            Some(id),
            None,
            "created",
            json!({
                "title": new.title,
                "assignee": new.assignee,
                "priority": new.priority,
                "status": status,
                "parents": parents,
            }),
            now,
        )?;
        Ok(Created { id, existed: false })
    }

    /// Makes `child` depend on `parent`. Refuses a cycle, naming it. A ready child whose new
    /// parent is unfinished goes back to `todo`.
    pub fn link(&self, parent: TaskId, child: TaskId, now: Millis) -> Result<()> {
        if parent == child {
            return Err(BoardError::Invalid(format!(
                "task {parent} cannot depend on itself"
            )));
        }
        let parent_status = self.task_status(parent)?;
        let child_status = self.task_status(child)?;
        let linked: bool = self
            .conn
            .prepare_cached("SELECT 1 FROM task_links WHERE parent_id = ?1 AND child_id = ?2")?
            .exists(params![parent, child])?;
        if linked {
            return Ok(()); // Linking the same pair again is a no-op, whatever the child does now.
        }
        if matches!(
            child_status,
            TaskStatus::Done | TaskStatus::Archived | TaskStatus::Running
        ) {
            // Finished, it never runs again; running, this run does not wait: a link would say
            // it waits when it does not.
            return Err(BoardError::Invalid(format!(
                "task {child} is {}: only a task that is not running or finished can be made \
                 to wait for another",
                child_status.as_str()
            )));
        }
        if let Some(path) = self.dependency_path(child, parent)? {
            // path runs child → … → parent through existing links; the new link closes it.
            let cycle: Vec<String> = std::iter::once(parent)
                .chain(path)
                .map(|id| id.to_string())
                .collect();
            return Err(BoardError::Invalid(format!(
                "link {parent} -> {child} would create a cycle: {}",
                cycle.join(" -> ")
            )));
        }
        let inserted = self
            .conn
            .prepare_cached(
                "INSERT OR IGNORE INTO task_links (parent_id, child_id) VALUES (?1, ?2)",
            )?
            .execute(params![parent, child])?;
        if inserted == 0 {
            return Ok(());
        }
        self.append_event(
            Some(child),
            None,
            "linked",
            json!({ "parent": parent }),
            now,
        )?;
        if child_status == TaskStatus::Ready && !parent_status.satisfies_dependency() {
            self.set_status(child, TaskStatus::Ready, TaskStatus::Todo, now)?;
            self.append_event(
                Some(child),
                None,
                "demoted",
                json!({ "reason": "waiting_for_parent", "parent": parent }),
                now,
            )?;
        }
        Ok(())
    }

    /// The chain of links from `from` down to `to` (both included), if `to` is a descendant.
    fn dependency_path(&self, from: TaskId, to: TaskId) -> Result<Option<Vec<TaskId>>> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT child_id FROM task_links WHERE parent_id = ?1")?;
        // Depth-first search with an explicit stack and the predecessor of each visited node.
        let mut came_from = std::collections::HashMap::new();
        let mut stack = vec![from];
        came_from.insert(from, from);
        while let Some(node) = stack.pop() {
            if node == to {
                let mut path = vec![to];
                let mut cur = to;
                while cur != from {
                    cur = came_from[&cur];
                    path.push(cur);
                }
                path.reverse();
                return Ok(Some(path));
            }
            let children: Vec<TaskId> = stmt
                .query_map([node], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            for c in children {
                if let std::collections::hash_map::Entry::Vacant(e) = came_from.entry(c) {
                    e.insert(node);
                    stack.push(c);
                }
            }
        }
        Ok(None)
    }

    /// Adds a comment to a task.
    pub fn comment(&self, task_id: TaskId, author: &str, body: &str, now: Millis) -> Result<i64> {
        self.task_status(task_id)?;
        if body.trim().is_empty() {
            return Err(BoardError::Invalid("comment must not be empty".into()));
        }
        if author.trim().is_empty() {
            return Err(BoardError::Invalid(
                "a comment's author must not be empty".into(),
            ));
        }
        self.conn
            .prepare_cached(
                "INSERT INTO task_comments (task_id, author, body, at) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![task_id, author, body, now])?;
        let id = self.conn.last_insert_rowid();
        self.append_event(
            Some(task_id),
            None,
            "commented",
            json!({ "author": author, "comment_id": id }),
            now,
        )?;
        Ok(id)
    }

    /// Returns a blocked task to `ready` (or `todo` while a parent is unfinished) with its
    /// failure count reset: an operator's decision to try again.
    pub fn unblock_task(&self, task_id: TaskId, now: Millis) -> Result<TaskStatus> {
        let status = self.task_status(task_id)?;
        if status != TaskStatus::Blocked {
            return Err(BoardError::Conflict(format!(
                "task {task_id} is {status}, not blocked"
            )));
        }
        let next = if self.parents_satisfied(task_id)? {
            TaskStatus::Ready
        } else {
            TaskStatus::Todo
        };
        self.conn
            .prepare_cached(
                "UPDATE tasks SET status = ?2, block_reason = NULL, consecutive_failures = 0, \
                 not_before = 0, updated_at = ?3 WHERE id = ?1 AND status = 'blocked'",
            )?
            .execute(params![task_id, next.as_str(), now])?;
        self.append_event(
            Some(task_id),
            None,
            "unblocked",
            json!({ "status": next }),
            now,
        )?;
        Ok(next)
    }

    /// Archives a task. A running task's run is closed as `archived` first; its evidence is
    /// returned so the caller ends the worker.
    pub fn archive_task(&self, task_id: TaskId, now: Millis) -> Result<Option<ClosedRun>> {
        let task = self.get_task(task_id)?;
        if task.status == TaskStatus::Archived {
            return Err(BoardError::Conflict(format!(
                "task {task_id} is already archived"
            )));
        }
        let closed = match task.current_run_id {
            Some(run_id) if task.status == TaskStatus::Running => Some(self.close_run(
                run_id,
                RunOutcome::Archived,
                now,
                None,
                Some("task archived"),
            )?),
            _ => None,
        };
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE tasks SET status = 'archived', current_run_id = NULL, updated_at = ?2 \
                 WHERE id = ?1 AND status = ?3",
            )?
            .execute(params![task_id, now, task.status.as_str()])?;
        changed_one(changed, task_id)?;
        // The run it closed, if it was running (as `reclaimed` and `blocked` name theirs).
        self.append_event(
            Some(task_id),
            closed.as_ref().map(|c| c.run_id),
            "archived",
            json!({ "from": task.status }),
            now,
        )?;
        self.promote_children(task_id, now)?;
        Ok(closed)
    }

    /// Promotes the `todo` children of `parent` whose parents are now all finished.
    pub fn promote_children(&self, parent: TaskId, now: Millis) -> Result<Vec<TaskId>> {
        let children: Vec<TaskId> = self
            .conn
            .prepare_cached(
                "SELECT t.id FROM task_links l JOIN tasks t ON t.id = l.child_id \
                 WHERE l.parent_id = ?1 AND t.status = 'todo'",
            )?
            .query_map([parent], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        self.promote(children, now)
    }

    /// Promotes every `todo` task whose parents are all finished (the sweep's safety net; the
    /// transitions promote children directly). O(todo rows).
    pub fn promote_ready(&self, now: Millis) -> Result<Vec<TaskId>> {
        let ids: Vec<TaskId> = self
            .conn
            .prepare_cached("SELECT id FROM tasks WHERE status = 'todo'")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        self.promote(ids, now)
    }

    fn promote(&self, candidates: Vec<TaskId>, now: Millis) -> Result<Vec<TaskId>> {
        let mut promoted = Vec::new();
        for id in candidates {
            if self.parents_satisfied(id)?
                && self.set_status(id, TaskStatus::Todo, TaskStatus::Ready, now)?
            {
                self.append_event(Some(id), None, "promoted", json!({}), now)?;
                promoted.push(id);
            }
        }
        Ok(promoted)
    }

    /// True when every parent of `task_id` is done or archived.
    pub fn parents_satisfied(&self, task_id: TaskId) -> Result<bool> {
        let open: i64 = self
            .conn
            .prepare_cached(
                "SELECT count(*) FROM task_links l JOIN tasks p ON p.id = l.parent_id \
                 WHERE l.child_id = ?1 AND p.status NOT IN ('done', 'archived')",
            )?
            .query_row([task_id], |r| r.get(0))?;
        Ok(open == 0)
    }

    /// Compare-and-swap on a task's status; true if it changed.
    pub(super) fn set_status(
        &self,
        id: TaskId,
        from: TaskStatus,
        to: TaskStatus,
        now: Millis,
    ) -> Result<bool> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE tasks SET status = ?3, updated_at = ?4 WHERE id = ?1 AND status = ?2",
            )?
            .execute(params![id, from.as_str(), to.as_str(), now])?;
        Ok(n == 1)
    }
}
