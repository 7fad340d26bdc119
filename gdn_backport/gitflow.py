"""``apply --commit`` / ``--format-patch``: the backport as a git commit.

Every precondition (identity, branch name, a clean tree, each file of every
patchset tracked and as in HEAD) is checked before anything is written. The
commit is built *before* the engine writes, from HEAD's tree with the
patched files' new bytes (a private index, ``git commit-tree``), so a git
failure stops the run with the tree untouched. Only then does the engine
write, and the branch is made at HEAD, checked out, and moved to the
prepared commit: the working tree already holds exactly its bytes. A
failure after the first write puts back every file and the records folder.

The run's objects (blobs, trees, commits) go to an object folder of their
own, with the repository's as an alternate (git's quarantine, as for a
push), and move into the repository only when the branch is made: a
refused run leaves no object behind.

What is committed is only what the engine wrote. The records of
``revert`` (``.gdn-backport/``) ignore themselves (their own ``.gitignore``)
and stay untracked: ``gdn-backport revert`` keeps working on the branch.

``--format-patch FILE`` without ``--commit`` writes the patch of that same
commit and changes neither the tree nor any branch, nor the object store.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import git

from gdn_backport import __version__, atomic, pipeline, registry
from gdn_backport.context import Vllm
from gdn_backport.errors import UsageError
from gdn_backport.pipeline import Mode, Outcome
from gdn_backport.registry import Patchset
from gdn_backport.tree import relative, tree_root
from gdn_backport.vllm_version import VllmVersion, detect

__all__ = ["GitResult", "apply_git", "commit_message", "default_branch"]

# File names are names, not pathspec patterns.
LITERAL = {"GIT_LITERAL_PATHSPECS": "1"}


@dataclass
class GitResult:
    outcome: Outcome
    repo: Path
    branch: str | None = None  # made and checked out (--commit)
    commit: str | None = None  # full sha of the (last) backport commit
    commits: list[str] = field(default_factory=list)  # one per patchset, in order
    previous: str | None = None  # what HEAD was: a branch name or a sha
    patch: Path | None = None  # the mbox written (--format-patch)
    paths: list[str] = field(default_factory=list)  # repo-relative, committed
    vllm_version: VllmVersion | None = None  # of the tree before the run

    def to_json(self) -> dict[str, object]:
        return {
            "repo": str(self.repo),
            "branch": self.branch,
            "commit": self.commit,
            "commits": self.commits,
            "previous": self.previous,
            "patch": None if self.patch is None else str(self.patch),
            "paths": self.paths,
        }

    def lines(self) -> list[str]:
        out = []
        if self.branch and self.commit:
            out.append(f"branch {self.branch}: commit {self.commit[:12]} (was on {self.previous})")
            out.append(f"undo: git checkout {self.previous} && git branch -D {self.branch}")
        if self.patch:
            out.append(f"patch: {self.patch} (apply with `git am {self.patch}`)")
        return out


def default_branch(chosen: Sequence[Patchset] | None = None) -> str:
    """``gdn-backport/<id>``, or for several patchsets their ids joined by ``+``."""
    ids = [p.info.id for p in chosen] if chosen else [registry.discover()[0].info.id]
    return "gdn-backport/" + "+".join(ids)


def apply_git(
    tree: Path,
    strategy: str | None = None,
    *,
    commit: bool = True,
    branch: str | None = None,
    allow_dirty: bool = False,
    patch: Path | None = None,
    kernels: Sequence[Path] = (),
    fixes: Sequence[Patchset] | None = None,
    vllm: Vllm | None = None,
) -> GitResult:
    """Patch ``tree`` and commit the result on a new branch, one commit per
    patchset that changes something (each with its own ``Backport-Of``
    trailer), and/or write the patch series of those commits to ``patch``.
    UsageError (nothing changed, no git object left) on any precondition; no
    branch, commit or patch when nothing needs fixing."""
    if not commit and patch is None:
        raise UsageError("apply: --commit or --format-patch FILE is needed here")
    chosen = list(fixes) if fixes is not None else list(registry.discover())
    root = tree_root(tree)
    # --commit writes: the whole run (the dirty check, the write, the branch)
    # holds the tree's lock; --format-patch alone writes nothing in the tree.
    lock: contextlib.AbstractContextManager[None] = (
        atomic.tree_lock(root) if commit else contextlib.nullcontext()
    )
    with lock, _open(root) as (repo, top), _quarantine(repo) as objects:
        result = GitResult(Outcome(root), top)
        version = result.vllm_version = detect(root)
        commits: list[str] = []
        named: list[str] = []
        undo = _Undo(root, active=commit)

        def before_write(writing: list[tuple[Patchset, Outcome, list[tuple[Path, bytes]]]]) -> None:
            # Every plan is made: the patchsets that change something name
            # the branch, and every precondition is checked for all of them
            # before the first object is made.
            name = branch or default_branch([ps for ps, _, _ in writing])
            _check_repo(repo, top, name if commit else None, allow_dirty or not commit)
            per_patchset = [
                (ps, out, staged, {_repo_path(top, f): data for f, data in staged})
                for ps, out, staged in writing
            ]
            _check_planned(repo, top, [list(files) for _, _, _, files in per_patchset])
            _check_identity(repo, top)
            if patch is not None:
                _check_patch_file(patch)
            for ps, out, staged, files in per_patchset:
                names = {relative(f, root): _repo_path(top, f) for f, _ in staged}
                message = commit_message(out, ps.strategy(strategy), version, names, ps)
                parent = commits[-1] if commits else None
                commits.append(_commit_object(repo, files, message, objects.env, parent))
                result.paths = sorted({*result.paths, *files})
                for f, data in staged:
                    real = f.resolve()
                    undo.files.setdefault(real, (real.read_bytes(), data))
            named.append(name)

        mode = Mode.WRITE if commit else Mode.DRY_RUN
        try:
            results = pipeline.apply(
                tree, chosen, strategy, mode, before_write=before_write, kernels=kernels, vllm=vllm
            )
        except UsageError as exc:
            raise UsageError(f"{exc}{undo()}") from exc
        out = result.outcome = pipeline.merged(results, root)
        if out.refused or not commits:
            if not out.refused:
                out.message += "; no commit made"
            return result
        result.commit = commits[-1]
        result.commits = list(commits)
        branch = named[0]
        # Staged before the branch is made: a patch that cannot be written
        # (a full disk) stops the run with nothing changed.
        staged = None
        if patch is not None:
            staged = atomic.stage(patch, _format_patch(repo, commits, objects.env))
        try:
            if commit:
                result.previous = _head_name(repo)
                _switch(repo, branch, result.commit, result.paths, undo, objects)
                result.branch = branch
                out.message = (
                    f"patched and committed {len(out.written)} file(s) on branch {branch}"
                    + (f" in {len(commits)} commits" if len(commits) > 1 else "")
                )
            else:
                out.message = "patch written; the tree and its branches were not changed"
            if patch is not None and staged is not None:
                try:
                    atomic.commit(staged, patch)
                except OSError as exc:
                    made = f"; branch {branch} is made" if commit else ""
                    raise UsageError(f"{patch}: cannot write ({exc.strerror}){made}") from exc
                result.patch = patch
        finally:
            if staged is not None:
                staged.unlink(missing_ok=True)
    return result


def commit_message(
    out: Outcome,
    strategy: str,
    version: VllmVersion | None,
    names: dict[str, str],
    fix: Patchset | None = None,
) -> str:
    """Subject naming the PR; body: strategy, tool, vLLM version, files and
    sites with their before -> after status; the ``Backport-Of`` trailer last.
    ``names``: each patched file's tree-relative path -> its repo path;
    ``fix``: the patchset (default: the first)."""
    fix = fix or registry.discover()[0]
    info = fix.info
    vllm = "unknown" if version is None else f"{version.version} (from {version.source})"
    body = [
        f"Backport vLLM PR #{info.number}: {info.summary}",
        "",
        f"Upstream: {info.upstream}",
        f"  {info.title}",
        f"Strategy: {fix.describe(strategy)}",
        f"Tool: gdn-backport {__version__}",
        f"vLLM version: {vllm}",
        "",
        "Files and sites:",
    ]
    for rel, shown in sorted(names.items(), key=lambda item: item[1]):
        body.append(f"  {shown}")
        body += [
            f"    {c.site.function}: {c.site.status.value} -> {c.rewritten.status.value}"
            for c in out.changes
            if c.site.path == rel and c.site.patchset == info.id
        ]
    body += ["", info.trailer]
    return "\n".join(body) + "\n"


@contextlib.contextmanager
def _open(root: Path) -> Iterator[tuple[git.Repo, Path]]:
    try:
        repo = git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError) as exc:
        raise UsageError(f"{root}: not in a git work tree (--commit/--format-patch)") from exc
    with repo:
        if repo.bare or repo.working_tree_dir is None:
            raise UsageError(f"{root}: a bare git repository has no work tree")
        yield repo, Path(repo.working_tree_dir).resolve()


def _check_repo(repo: git.Repo, top: Path, branch: str | None, allow_dirty: bool) -> None:
    if not repo.head.is_valid():
        raise UsageError(f"{top}: the repository has no commit yet; commit the tree first")
    if branch is not None:
        try:
            repo.git.check_ref_format("--branch", branch)
        except git.GitCommandError as exc:
            raise UsageError(f"{top}: --branch {branch}: not a valid branch name") from exc
        if branch in repo.heads:
            raise UsageError(
                f"{top}: branch {branch} already exists; name another with --branch "
                f"or delete it (git branch -D {branch})"
            )
    if not allow_dirty:
        # Untracked files do not count: the branch is made at HEAD (the work
        # tree is not touched) and only our paths are committed.
        dirty = repo.git.status("--porcelain", "--untracked-files=no").splitlines()
        if dirty:
            names = ", ".join(d[3:] for d in dirty[:3]) + (", ..." if len(dirty) > 3 else "")
            raise UsageError(
                f"{top}: uncommitted changes ({names}); commit or stash them, "
                "or pass --allow-dirty (only the patched files are committed)"
            )


def _check_targets(repo: git.Repo, top: Path, paths: list[str]) -> None:
    """Each file to patch is tracked and exactly as in HEAD: else the commit
    would carry the user's own edits (or an untracked file) as ours."""
    status = repo.git.status(
        "--porcelain", "--ignored", "--untracked-files=all", "--", *paths, env=LITERAL
    )
    for entry in status.splitlines():
        code, rel = entry[:2], entry[3:]
        why = {"??": "not tracked by git", "!!": "ignored by git"}.get(
            code, "has uncommitted changes"
        )
        raise UsageError(f"{top / rel}: {why}; the backport commit would include it")


def _check_identity(repo: git.Repo, top: Path) -> None:
    """Who the commit is by: asked before the first object is made."""
    for who in ("GIT_AUTHOR_IDENT", "GIT_COMMITTER_IDENT"):
        try:
            repo.git.var(who)
        except git.GitCommandError as exc:
            why = (exc.stderr or str(exc)).strip().splitlines()
            raise UsageError(
                f"{top}: git cannot make the commit ({why[-1] if why else exc})"
            ) from exc


def _check_planned(repo: git.Repo, top: Path, planned: list[list[str]]) -> None:
    """The files every patchset will rewrite (planned in a dry run), checked
    before the first one writes: no file rewritten twice, each one clean."""
    seen: set[str] = set()
    for paths in planned:
        overlap = sorted(seen & set(paths))
        if overlap:
            raise UsageError(
                f"{top / overlap[0]}: two patchsets rewrite this file; commit them "
                "one at a time (--patchset)"
            )
        seen |= set(paths)
    if seen:
        _check_targets(repo, top, sorted(seen))


class _Undo:
    """What ``apply --commit`` wrote in the tree, to put back when the run
    fails after its first write: each file (its bytes before and after)
    and the records folder (every file but the lock, as it was). Inactive
    for ``--format-patch`` alone, which writes nothing in the tree (and
    holds no lock)."""

    def __init__(self, root: Path, active: bool) -> None:
        self.state = root / atomic.STATE_DIR
        self.active = active
        self.files: dict[Path, tuple[bytes, bytes]] = {}
        self.records: dict[str, bytes | None] | None = None
        if active:
            with contextlib.suppress(OSError):
                self.records = _folder(self.state)

    def __call__(self) -> str:
        """Put it back; what could not be, as a clause for the message."""
        kept = ""
        if not self.active or not self.files:
            return kept
        for file, (old, new) in self.files.items():
            try:
                if file.read_bytes() == new:
                    atomic.write_atomic(file, old)
            except (OSError, UsageError) as exc:
                kept += f"; {file} keeps the new bytes (cannot put it back: {exc})"
        if not kept and self.records is not None:
            # Every file is as before: so must their records be. A file
            # left patched keeps its record, for revert.
            with contextlib.suppress(OSError, UsageError):
                _restore_folder(self.state, self.records)
        return kept


def _folder(state: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) below ``state``, the lock aside."""
    found: dict[str, bytes | None] = {}
    if state.is_symlink() or not state.is_dir():
        return found
    for dirpath, dirnames, filenames in os.walk(state):
        for name in dirnames:
            found[Path(dirpath, name).relative_to(state).as_posix()] = None
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(state).as_posix()
            if rel != atomic.LOCK and not path.is_symlink():
                found[rel] = path.read_bytes()
    return found


def _restore_folder(state: Path, was: dict[str, bytes | None]) -> None:
    now = _folder(state)
    for rel in sorted(now, reverse=True):  # a folder's files before the folder
        if rel not in was:
            if now[rel] is None:
                (state / rel).rmdir()
            else:
                (state / rel).unlink()
    for rel, data in sorted(was.items()):
        if data is None:
            (state / rel).mkdir(exist_ok=True)
        elif now.get(rel) != data:
            atomic.write_atomic(state / rel, data)


class _Objects:
    """This run's git objects, in a folder of their own until the branch is made."""

    def __init__(self, folder: Path, store: Path) -> None:
        self.folder = folder
        self.store = store
        alternates = [str(store), *filter(None, [os.environ.get(_ALTERNATES)])]
        self.env = {"GIT_OBJECT_DIRECTORY": str(folder), _ALTERNATES: os.pathsep.join(alternates)}

    def migrate(self) -> None:
        """Link every object into the repository's store (content-addressed:
        one there already is the same); on failure, take those back."""
        linked: list[Path] = []
        try:
            for dirpath, _, filenames in os.walk(self.folder):
                for name in filenames:
                    src = Path(dirpath, name)
                    dest = self.store / src.relative_to(self.folder)
                    dest.parent.mkdir(exist_ok=True)
                    with contextlib.suppress(FileExistsError):
                        os.link(src, dest)
                        linked.append(dest)
        except OSError:
            for dest in linked:
                dest.unlink(missing_ok=True)
            raise


_ALTERNATES = "GIT_ALTERNATE_OBJECT_DIRECTORIES"


@contextlib.contextmanager
def _quarantine(repo: git.Repo) -> Iterator[_Objects]:
    where = Path(repo.git.rev_parse("--git-path", "objects"))
    store = (Path(repo.working_tree_dir or ".") / where).resolve()
    try:
        # Named as git names its own: `git gc` removes one a killed run left.
        folder = tempfile.mkdtemp(prefix="tmp_objdir-gdn-backport-", dir=store)
    except OSError as exc:
        raise UsageError(f"{store}: cannot write git objects ({exc.strerror})") from exc
    try:
        yield _Objects(Path(folder), store)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _check_patch_file(patch: Path) -> None:
    if patch.is_dir():
        raise UsageError(f"{patch}: is a folder (--format-patch takes a file name)")
    if not patch.parent.is_dir():
        raise UsageError(f"{patch}: no folder {patch.parent} to write the patch in")
    # Written last, after the commit: find out now that it can be written.
    atomic.stage(patch, b"").unlink()


def _repo_path(top: Path, file: Path) -> str:
    return relative(file.resolve(), top)


def _commit_object(
    repo: git.Repo,
    files: dict[str, bytes],
    message: str,
    objects: dict[str, str],
    parent: str | None = None,
) -> str:
    """A commit of ``parent``'s tree (default HEAD) with ``files`` replaced,
    referenced by nothing, its objects written where ``objects`` (git's
    environment) says."""
    head = repo.head.commit
    base = parent or head.hexsha
    with tempfile.TemporaryDirectory(prefix="gdn-backport-") as tmp:
        env = {**objects, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            repo.git.read_tree(base, env=env)
            for rel, data in files.items():
                blob = Path(tmp) / "blob"
                blob.write_bytes(data)
                # --path: the file's own attributes (eol, filters) apply, as
                # `git add` would store it.
                sha = repo.git.hash_object("-w", f"--path={rel}", str(blob), env=env)
                # HEAD's mode: a patchset changes bytes only (and no file twice).
                mode = f"{(head.tree / rel).mode:o}"
                repo.git.update_index("--cacheinfo", f"{mode},{sha},{rel}", env=env)
            tree = repo.git.write_tree(env=env)
            return str(repo.git.commit_tree(tree, "-p", base, "-m", message, env=env))
        except git.GitCommandError as exc:
            why = (exc.stderr or str(exc)).strip().splitlines()
            raise UsageError(
                f"{repo.working_tree_dir}: git cannot make the commit ({why[-1] if why else exc})"
            ) from exc


def _head_name(repo: git.Repo) -> str:
    return str(repo.head.commit.hexsha) if repo.head.is_detached else str(repo.active_branch.name)


def _switch(
    repo: git.Repo,
    branch: str,
    sha: str,
    paths: list[str],
    undo: Callable[[], str],
    objects: _Objects,
) -> None:
    """Make ``branch`` at HEAD, check it out, move it to ``sha`` (whose files
    the work tree already holds), refresh those index entries and move the
    run's objects into the repository. Nothing else in the index or the
    work tree is touched. On failure, undo all."""
    previous = _head_name(repo)
    made = False
    env = objects.env
    try:
        # Checking out a branch at HEAD keeps every local change (ours too).
        repo.git.checkout("-q", "-b", branch, env=env)
        made = True
        repo.git.reset("-q", "--soft", sha, env=env)
        repo.git.reset("-q", "--", *paths, env={**LITERAL, **env})
        objects.migrate()
    except (git.GitCommandError, OSError) as exc:
        # Files first (ours only: records of earlier runs stay): with them
        # back at HEAD's bytes, checking the previous branch out cannot conflict.
        kept = undo()
        with contextlib.suppress(git.GitCommandError):
            if made:
                repo.git.checkout("-q", previous, env=env)
                repo.git.branch("-D", branch, env=env)
        if isinstance(exc, git.GitCommandError):
            lines = (exc.stderr or str(exc)).strip().splitlines()
            why = lines[-1] if lines else str(exc)
        else:
            why = f"cannot move the commit into {objects.store}: {exc.strerror}"
        files = "the branches" if kept else "the files and branches"
        raise UsageError(
            f"{repo.working_tree_dir}: git failed ({why}); {files} are as before{kept}"
        ) from exc


def _format_patch(repo: git.Repo, commits: list[str], objects: dict[str, str]) -> bytes:
    # The a/ b/ prefixes `git am` expects, whatever the user's diff config.
    data = repo.git(c="diff.noprefix=false").format_patch(
        f"-{len(commits)}",
        "--stdout",
        commits[-1],
        stdout_as_string=False,
        strip_newline_in_stdout=False,
        env=objects,
    )
    return bytes(data)
