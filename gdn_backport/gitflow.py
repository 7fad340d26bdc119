"""``apply --commit`` / ``--format-patch``: the backport as a git commit.

The commit is built *before* anything is written, from HEAD's tree with the
patched files' new bytes (a private index, ``git commit-tree``), so every git
failure (no identity, a bad branch name, a file with the user's own edits)
stops the run with the tree untouched. Only then does the engine write, and
the branch is made at HEAD, checked out, and moved to the prepared commit:
the working tree already holds exactly its bytes.

What is committed is only what the engine wrote. The records of
``revert`` (``.gdn-backport/``) ignore themselves (their own ``.gitignore``)
and stay untracked: ``gdn-backport revert`` keeps working on the branch.

``--format-patch FILE`` without ``--commit`` writes the patch of that same
commit and changes neither the tree nor any branch: the commit object is
referenced by nothing and git's gc drops it.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import git

from gdn_backport import __version__, atomic, pipeline, registry
from gdn_backport.errors import UsageError
from gdn_backport.pipeline import Mode, Outcome, revert_tree
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
) -> GitResult:
    """Patch ``tree`` and commit the result on a new branch, one commit per
    patchset that changes something (each with its own ``Backport-Of``
    trailer), and/or write the patch series of those commits to ``patch``.
    UsageError (nothing changed, no git object made) on any precondition; no
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
    with lock, _open(root) as (repo, top):
        result = GitResult(Outcome(root), top)
        version = result.vllm_version = detect(root)
        commits: list[str] = []
        named: list[str] = []

        def before_write(writing: list[tuple[Patchset, Outcome, list[tuple[Path, bytes]]]]) -> None:
            # Every precondition first, then the objects: a refusal leaves
            # no object in the repository.
            name = branch or default_branch([ps for ps, _, _ in writing])
            _check_repo(repo, top, name if commit else None, allow_dirty or not commit)
            if patch is not None:
                _check_patch_file(patch)
            per_patchset = []
            seen: set[str] = set()
            for ps, out, staged in writing:
                files = {_repo_path(top, f): data for f, data in staged}
                overlap = sorted(set(files) & seen)
                if overlap:
                    raise UsageError(
                        f"{top / overlap[0]}: two patchsets rewrite this file; commit them "
                        "one at a time (--patchset)"
                    )
                seen |= set(files)
                names = {relative(f, root): _repo_path(top, f) for f, _ in staged}
                per_patchset.append((ps, out, files, names))
            _check_targets(repo, top, sorted(seen))
            for ps, out, files, names in per_patchset:
                message = commit_message(out, ps.strategy(strategy), version, names, ps)
                parent = commits[-1] if commits else None
                commits.append(_commit_object(repo, files, message, parent))
            result.paths = sorted(seen)
            named.append(name)

        mode = Mode.WRITE if commit else Mode.DRY_RUN
        results = pipeline.apply(
            tree, chosen, strategy, mode, before_write=before_write, kernels=kernels
        )
        out = result.outcome = pipeline.merged(results, root)
        if out.refused or not commits:
            if not out.refused:
                out.message += "; no commit made"
            return result
        result.commit = commits[-1]
        result.commits = list(commits)
        if commit:
            result.previous = _head_name(repo)
            _switch(repo, named[0], result.commit, result.paths, root, out.written)
            result.branch = named[0]
            out.message = (
                f"patched and committed {len(out.written)} file(s) on branch {named[0]}"
                + (f" in {len(commits)} commits" if len(commits) > 1 else "")
            )
        else:
            out.message = "patch written; the tree and its branches were not changed"
        if patch is not None:
            atomic.write_atomic(patch, _format_patch(repo, commits))
            result.patch = patch
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
    repo: git.Repo, files: dict[str, bytes], message: str, parent: str | None = None
) -> str:
    """A commit of ``parent``'s tree (default HEAD) with ``files`` replaced,
    referenced by nothing."""
    head = repo.commit(parent) if parent else repo.head.commit
    with tempfile.TemporaryDirectory(prefix="gdn-backport-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            repo.git.read_tree(head.hexsha, env=env)
            for rel, data in files.items():
                blob = Path(tmp) / "blob"
                blob.write_bytes(data)
                # --path: the file's own attributes (eol, filters) apply, as
                # `git add` would store it.
                sha = repo.git.hash_object("-w", f"--path={rel}", str(blob))
                mode = f"{(head.tree / rel).mode:o}"
                repo.git.update_index("--cacheinfo", f"{mode},{sha},{rel}", env=env)
            tree = repo.git.write_tree(env=env)
            return str(repo.git.commit_tree(tree, "-p", head.hexsha, "-m", message))
        except git.GitCommandError as exc:
            why = (exc.stderr or str(exc)).strip().splitlines()
            raise UsageError(
                f"{repo.working_tree_dir}: git cannot make the commit ({why[-1] if why else exc})"
            ) from exc


def _head_name(repo: git.Repo) -> str:
    return str(repo.head.commit.hexsha) if repo.head.is_detached else str(repo.active_branch.name)


def _switch(
    repo: git.Repo, branch: str, sha: str, paths: list[str], root: Path, written: list[str]
) -> None:
    """Make ``branch`` at HEAD, check it out, move it to ``sha`` (whose files
    the work tree already holds) and refresh those index entries. Nothing
    else in the index or the work tree is touched. On failure, undo all."""
    previous = _head_name(repo)
    made = False
    try:
        # Checking out a branch at HEAD keeps every local change (ours too).
        repo.git.checkout("-q", "-b", branch)
        made = True
        repo.git.reset("-q", "--soft", sha)
        repo.git.reset("-q", "--", *paths, env=LITERAL)
    except git.GitCommandError as exc:
        # Files first (ours only: records of earlier runs stay): with them
        # back at HEAD's bytes, checking the previous branch out cannot conflict.
        for rel in written:
            revert_tree(root / rel, root=root)
        with contextlib.suppress(git.GitCommandError):
            if made:
                repo.git.checkout("-q", previous)
                repo.git.branch("-D", branch)
        why = (exc.stderr or str(exc)).strip().splitlines()
        raise UsageError(
            f"{repo.working_tree_dir}: git failed ({why[-1] if why else exc}); "
            "the files and branches are as before"
        ) from exc


def _format_patch(repo: git.Repo, commits: list[str]) -> bytes:
    # The a/ b/ prefixes `git am` expects, whatever the user's diff config.
    data = repo.git(c="diff.noprefix=false").format_patch(
        f"-{len(commits)}",
        "--stdout",
        commits[-1],
        stdout_as_string=False,
        strip_newline_in_stdout=False,
    )
    return bytes(data)
