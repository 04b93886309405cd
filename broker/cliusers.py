"""`flowbroker user add/set/passwd/delete/list`: the users file (broker/users.py), edited on this host.

The commands write the file the broker reads (`[auth] users_file`, found from `--config` or the
default), not the admin API: creating the first user must work before anyone can log in, and the file's
permissions (0600) are the guard. The broker re-reads the file at the next login. Passwords are read
from a prompt (twice) or, for scripts, one line on stdin (`--password-stdin`); never from an argument,
which `ps` and shell history show.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

import click

from flowbroker.broker.config import AuthConfig, ConfigError, load_config
from flowbroker.broker.users import LIMITS, TAGS, User, UsersError, check_name, read_users, write_users
from flowbroker.protocol.saslprep import SaslprepError, saslprep
from flowbroker.protocol.scram import DEFAULT_ITERATIONS, StoredCredential

__all__ = ["user"]


def _options(func: Any) -> Any:
    func = click.option("--users-file", type=click.Path(dir_okay=False, path_type=Path),
                        help="The users file [default: [auth] users_file of --config, else ~/.flowbroker/users.json].")(func)
    func = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                        help="The broker's TOML file, to find its [auth] users_file.")(func)
    return func


def _path(config_path: Path | None, users_file: Path | None) -> Path:
    if users_file is not None:
        return users_file
    try:
        return load_config(config_path).auth.users_path()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _basic_clash(name: str, tags: tuple[str, ...]) -> None:
    """A user with an admin API tag may use HTTP Basic, whose `user:password` splits at the first colon (RFC
    7617): a name holding one could never be used there (`curl -u 'ad:min:pw'` answered 403, a tester)."""
    if tags and ":" in name:
        raise click.ClickException(f"user name {name!r} holds ':', so it could never use the admin API's HTTP Basic "
                                   f"(it splits user:password at the first colon): pick a name without ':' for a "
                                   f"user with --tag {tags[0]}")


def _loopback_clash(name: str, config_path: Path | None, adding: bool) -> None:
    """NAME is the broker's loopback user, whose name the broker never lets log in (a users-file user of it
    was the loopback clients' identity too; docs/security.md). Known from --config, `user add` is refused;
    without it (the default loopback user, `guest`, assumed) and for `user set/passwd` of a user already
    there, a warning on stderr."""
    if config_path is None:
        loopback, where = AuthConfig().loopback_user, "by default"
    else:
        try:
            loopback, where = load_config(config_path).auth.loopback_user, f"in {config_path}"
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
    if not loopback or name != loopback:
        return
    what = (f"{name!r} is the broker's loopback user ([auth] loopback_user {where}): a client without credentials "
            f"from a loopback address is {name!r}, and the broker refuses every client login with that name")
    if adding and config_path is not None:
        raise click.ClickException(f"{what}; pick another name, or set [auth] loopback_user to another name or \"\"")
    unsure = "" if config_path is not None else " (if the broker's [auth] loopback_user is another, give its --config)"
    click.echo(f"Warning: {what}{unsure}", err=True)


def _name(name: str, stored: bool = False) -> str:
    """NAME as logins look it up: SASLprepped (RFC 4013); a new one may not hold unassigned code points."""
    try:
        return saslprep(name, stored=stored, what="user name")
    except SaslprepError as exc:
        raise click.ClickException(str(exc)) from None


def _read(path: Path) -> dict[str, User]:
    try:
        return read_users(path)
    except UsersError as exc:
        raise click.ClickException(str(exc)) from None


def _password(from_stdin: bool) -> str:
    if from_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    if not password:
        raise click.ClickException("the password is empty")
    return password


def _grant_options(adding: bool) -> Callable[[Any], Any]:
    """A user's permissions and limits, the same options for `user add` (with their defaults: every
    name, no limit) and `user set` (None: left as it is)."""
    options = [
        ("--configure", "configure", str, ".*", "Queues and exchanges it may declare and delete (regex)."),
        ("--write", "write", str, ".*", "Exchanges it may publish to, queues it may bind (regex)."),
        ("--read", "read_", str, ".*", "Queues it may consume from, exchanges it may bind from (regex)."),
        ("--max-connections", "max_connections", click.IntRange(0, 1_000_000), 0,
         "Connections open at once as this user (0 = no limit of its own)."),
        ("--max-queues", "max_queues", click.IntRange(0, 1_000_000), 0,
         "Queues this user declared that exist at once (0 = no limit of its own)."),
        ("--credit-share-percent", "credit_share_percent", click.FloatRange(0, 100), 0,
         "The most of the producer credit pool its producers hold together, in percent (0 = no cap)."),
    ]

    def decorate(func: Any) -> Any:
        for flag, dest, kind, default, help_ in reversed(options):
            func = click.option(flag, dest, type=kind, default=default if adding else None, show_default=adding,
                                help=help_)(func)
        return func

    return decorate


@click.group()
def user() -> None:
    """Users who may connect and use the admin API (docs/security.md)."""


@user.command("add")
@click.argument("name")
@click.option("--password-stdin", is_flag=True, help="Read the password from the first line of stdin.")
@click.option("--tag", "tags", multiple=True, type=click.Choice(TAGS), help="Admin API tag (repeatable).")
@_grant_options(adding=True)
@click.option("--iterations", type=click.IntRange(4096, 10_000_000), default=DEFAULT_ITERATIONS, show_default=True,
              help="PBKDF2 iterations of the stored credential.")
@_options
def user_add(name: str, password_stdin: bool, tags: tuple[str, ...], configure: str, write: str, read_: str,
             max_connections: int, max_queues: int, credit_share_percent: float, iterations: int,
             config_path: Path | None, users_file: Path | None) -> None:
    """Add user NAME."""
    path = _path(config_path, users_file)
    users = _read(path)
    name = _name(name, stored=True)
    try:
        check_name(name, str(path))  # what the broker would refuse, refused before it is written
    except UsersError as exc:
        raise click.ClickException(str(exc)) from None
    if name in users:
        raise click.ClickException(f"user {name!r} exists in {path} (change its password with `user passwd`)")
    _loopback_clash(name, config_path, adding=True)
    _basic_clash(name, tags)
    try:
        credential = StoredCredential.from_password(_password(password_stdin), iterations)
        users[name] = User(name, credential, tags, configure, write, read_, max_connections, max_queues,
                           credit_share_percent)
    except (UsersError, SaslprepError) as exc:
        raise click.ClickException(str(exc)) from None
    write_users(path, users)
    click.echo(f"added user {name} to {path}")


@user.command("passwd")
@click.argument("name")
@click.option("--password-stdin", is_flag=True, help="Read the password from the first line of stdin.")
@_options
def user_passwd(name: str, password_stdin: bool, config_path: Path | None, users_file: Path | None) -> None:
    """Change user NAME's password (connections already open stay open)."""
    path = _path(config_path, users_file)
    users = _read(path)
    name = _name(name)
    old = users.get(name)
    if old is None:
        raise click.ClickException(f"no user {name!r} in {path}")
    _loopback_clash(name, config_path, adding=False)
    try:
        credential = StoredCredential.from_password(_password(password_stdin), old.credential.iterations)
    except SaslprepError as exc:
        raise click.ClickException(str(exc)) from None
    users[name] = replace(old, credential=credential)
    write_users(path, users)
    click.echo(f"changed the password of {name}")


@user.command("delete")
@click.argument("name")
@_options
def user_delete(name: str, config_path: Path | None, users_file: Path | None) -> None:
    """Delete user NAME (connections already open stay open)."""
    path = _path(config_path, users_file)
    users = _read(path)
    name = _name(name)
    if users.pop(name, None) is None:
        raise click.ClickException(f"no user {name!r} in {path}")
    write_users(path, users)
    click.echo(f"deleted user {name}")


@user.command("set")
@click.argument("name")
@click.option("--tag", "tags", multiple=True, type=click.Choice(TAGS),
              help="Admin API tag (repeatable); replaces the user's tags. --no-tags removes them all.")
@click.option("--no-tags", is_flag=True, help="Remove every admin API tag.")
@_grant_options(adding=False)
@_options
def user_set(name: str, tags: tuple[str, ...], no_tags: bool, configure: str | None, write: str | None,
             read_: str | None, max_connections: int | None, max_queues: int | None,
             credit_share_percent: float | None, config_path: Path | None, users_file: Path | None) -> None:
    """Change user NAME's tags, permissions or limits in place; what is not given stays as it is.

    The broker re-reads the file within a second: open connections get the new permissions and credit
    share (subscriptions the new read pattern no longer allows end), and the limits count from then on."""
    if tags and no_tags:
        raise click.UsageError("--tag and --no-tags contradict each other")
    path = _path(config_path, users_file)
    users = _read(path)
    name = _name(name)
    old = users.get(name)
    if old is None:
        raise click.ClickException(f"no user {name!r} in {path} (add it with `user add`)")
    given: dict[str, Any] = {"configure": configure, "write": write, "read": read_, "max_connections": max_connections,
             "max_queues": max_queues, "credit_share_percent": credit_share_percent,
             "tags": () if no_tags else (tuple(dict.fromkeys(tags)) if tags else None)}
    changes: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
    if not changes:
        raise click.UsageError("nothing to change: give at least one of --tag/--no-tags, --configure, --write, "
                               "--read, --max-connections, --max-queues, --credit-share-percent")
    _basic_clash(name, tuple(changes.get("tags") or ()))
    try:
        users[name] = replace(old, **changes)
    except UsersError as exc:
        raise click.ClickException(str(exc)) from None
    _loopback_clash(name, config_path, adding=False)
    write_users(path, users)
    click.echo(f"changed {', '.join(sorted(changes))} of {name}")


@user.command("list")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: {NAME: {tags, configure, write, read, and the limits}} (no credentials).")
@_options
def user_list(as_json: bool, config_path: Path | None, users_file: Path | None) -> None:
    """The users, their tags, permissions (configure, write, read) and limits other than 0."""
    users = _read(_path(config_path, users_file))
    if as_json:
        click.echo(json.dumps({u.name: {"tags": list(u.tags), "configure": u.configure, "write": u.write,
                                        "read": u.read, **{key: getattr(u, key) for key in LIMITS}}
                               for u in users.values()}, indent=2))
        return
    for u in users.values():
        limits = "".join(f"\t{key}={getattr(u, key)}" for key in LIMITS if getattr(u, key))
        click.echo(f"{u.name}\t{','.join(u.tags) or '-'}\tconfigure={u.configure}\twrite={u.write}\tread={u.read}"
                   f"{limits}")
