"""`flowbroker user add/passwd/delete/list` over a users file in tmp_path, read back by the broker's store."""

from __future__ import annotations

import stat
from pathlib import Path

from click.testing import CliRunner

from flowbroker.broker.cli import main
from flowbroker.broker.users import UserStore, read_users


def run(*args: str, stdin: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), input=stdin)
    return result.exit_code, result.output


def test_add_passwd_list_delete(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "users.json"
    f = ["--users-file", str(path)]
    assert run("user", "add", "alice", "--password-stdin", "--tag", "administrator", "--write", "^orders$", *f,
               stdin="s3cret\n")[0] == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "s3cret" not in path.read_text()
    store = UserStore(path)
    alice = store.get("alice")
    assert alice is not None and alice.tags == ("administrator",) and alice.write == "^orders$"
    assert alice.credential.check_password("s3cret")
    code, out = run("user", "add", "alice", "--password-stdin", *f, stdin="x\n")
    assert code != 0 and "exists" in out
    assert run("user", "passwd", "alice", "--password-stdin", *f, stdin="n3w\n")[0] == 0
    store.refresh()
    alice = store.get("alice")
    assert alice is not None and alice.credential.check_password("n3w") and alice.write == "^orders$"
    code, out = run("user", "list", *f)
    assert code == 0 and out.startswith("alice\tadministrator\tconfigure=.*\twrite=^orders$")
    assert run("user", "delete", "alice", *f)[0] == 0
    assert read_users(path) == {}
    code, out = run("user", "delete", "alice", *f)
    assert code != 0 and "no user 'alice'" in out


def test_a_bad_pattern_or_empty_password_is_refused(tmp_path: Path) -> None:
    f = ["--users-file", str(tmp_path / "u.json")]
    code, out = run("user", "add", "a", "--password-stdin", "--read", "(", *f, stdin="pw\n")
    assert code != 0 and "read pattern" in out
    code, out = run("user", "add", "a", "--password-stdin", *f, stdin="\n")
    assert code != 0 and "empty" in out


def test_a_name_the_broker_would_refuse_is_not_written(tmp_path: Path) -> None:
    """An empty name used to be written, and then the file was refused whole: by the broker (nobody could
    log in) and by every later `user` command, `user delete` included."""
    path = tmp_path / "u.json"
    f = ["--users-file", str(path)]
    assert run("user", "add", "carol", "--password-stdin", *f, stdin="pw\n")[0] == 0
    for bad in ("", "x" * 256):
        code, out = run("user", "add", bad, "--password-stdin", *f, stdin="pw\n")
        assert code != 0 and "must be printable, 1..255 characters" in out, (bad, out)
    code, out = run("user", "list", *f)
    assert code == 0 and out.startswith("carol\t") and len(out.splitlines()) == 1
    assert list(read_users(path)) == ["carol"]


def test_an_admin_api_user_may_not_hold_a_colon_which_http_basic_could_never_carry(tmp_path: Path) -> None:
    """`curl -u 'ad:min:pw'` splits at the first colon: such an administrator was written, then answered 403
    for ever (a tester). Without an admin API tag the name is fine (PLAIN and SCRAM carry it)."""
    path = tmp_path / "u.json"
    f = ["--users-file", str(path)]
    code, out = run("user", "add", "ad:min", "--password-stdin", "--tag", "administrator", *f, stdin="pw\n")
    assert code != 0 and "HTTP Basic" in out and not path.exists()
    assert run("user", "add", "ad:min", "--password-stdin", *f, stdin="pw\n")[0] == 0
    code, out = run("user", "set", "ad:min", "--tag", "monitoring", *f)
    assert code != 0 and "HTTP Basic" in out
    user = read_users(path)["ad:min"]
    assert user.tags == ()


def test_the_store_keeps_the_last_good_users_when_the_file_turns_bad(tmp_path: Path) -> None:
    path = tmp_path / "u.json"
    run("user", "add", "a", "--password-stdin", "--users-file", str(path), stdin="pw\n")
    store = UserStore(path)
    generation = store.generation
    path.write_text("{not json")
    assert store.refresh() is not None and store.get("a") is not None and store.generation == generation


def test_resource_limits_are_written_kept_by_passwd_listed_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "u.json"
    f = ["--users-file", str(path)]
    assert run("user", "add", "b", "--password-stdin", "--max-connections", "3", "--max-queues", "5",
               "--credit-share-percent", "12.5", *f, stdin="pw\n")[0] == 0
    assert run("user", "passwd", "b", "--password-stdin", *f, stdin="n3w\n")[0] == 0
    b = read_users(path)["b"]
    assert (b.max_connections, b.max_queues, b.credit_share_percent) == (3, 5, 12.5)
    code, out = run("user", "list", *f)
    assert code == 0 and out.rstrip().endswith("max_connections=3\tmax_queues=5\tcredit_share_percent=12.5")
    code, out = run("user", "add", "c", "--password-stdin", "--credit-share-percent", "101", *f, stdin="pw\n")
    assert code != 0 and "credit-share-percent" in out
    path.write_text('{"users": {"d": {"password": "%s", "max_queues": -1}}}'
                    % read_users(path)["b"].credential.encode())
    try:
        read_users(path)
    except ValueError as exc:
        assert "max_queues must be an integer in [0, 1000000]" in str(exc)
    else:
        raise AssertionError("a negative max_queues was accepted")


def test_names_and_passwords_are_saslprepped(tmp_path: Path) -> None:
    f = ["--users-file", str(tmp_path / "u.json")]
    assert run("user", "add", "\u2168", "--password-stdin", *f, stdin="I\u00adX\u00a0pw\n")[0] == 0
    users = read_users(tmp_path / "u.json")
    assert list(users) == ["IX"] and users["IX"].credential.check_password("\u2168 pw")
    code, out = run("user", "add", "b", "--password-stdin", *f, stdin="bad\x07\n")
    assert code != 0 and "password: a control character (U+0007)" in out and "bad" not in out.split(":", 1)[1]
    assert run("user", "passwd", "I\u00adX", "--password-stdin", *f, stdin="new\n")[0] == 0  # found as IX
    (tmp_path / "u.json").write_text((tmp_path / "u.json").read_text().replace('"IX"', '"\\u2168"'))
    try:
        read_users(tmp_path / "u.json")
    except ValueError as exc:
        assert "user name 'Ⅸ' is not in its SASLprep form 'IX'" in str(exc)
    else:
        raise AssertionError("a name no login could match was accepted")


def test_set_changes_only_what_is_given(tmp_path: Path) -> None:
    """There was no way to change a user's limits or permissions in place but `user delete` and `user add`
    again, which also asked for the password anew (docs/security.md)."""
    path = tmp_path / "u.json"
    f = ["--users-file", str(path)]
    assert run("user", "add", "alice", "--password-stdin", "--read", "^a\\.", "--max-queues", "3", *f,
               stdin="pw\n")[0] == 0
    code, out = run("user", "set", "alice", "--write", "^orders$", "--max-connections", "4", "--tag", "monitoring", *f)
    assert code == 0, out
    alice = read_users(path)["alice"]
    assert (alice.write, alice.read, alice.max_connections, alice.max_queues, alice.tags) == \
        ("^orders$", "^a\\.", 4, 3, ("monitoring",))
    assert alice.credential.check_password("pw")
    assert run("user", "set", "alice", "--no-tags", "--max-queues", "0", *f)[0] == 0
    alice = read_users(path)["alice"]
    assert alice.tags == () and alice.max_queues == 0 and alice.max_connections == 4
    code, out = run("user", "set", "alice", "--read", "(", *f)
    assert code != 0 and "read pattern" in out and read_users(path)["alice"].read == "^a\\."
    code, out = run("user", "set", "alice", *f)
    assert code == 2 and "nothing to change" in out
    code, out = run("user", "set", "bob", "--max-queues", "1", *f)
    assert code == 1 and "no user 'bob'" in out
    code, out = run("user", "set", "alice", "--tag", "monitoring", "--no-tags", *f)
    assert code == 2 and "contradict" in out


def test_list_json_holds_no_credential(tmp_path: Path) -> None:
    import json
    path = tmp_path / "u.json"
    f = ["--users-file", str(path)]
    assert run("user", "add", "alice", "--password-stdin", "--max-queues", "2", *f, stdin="pw\n")[0] == 0
    code, out = run("user", "list", "--json", *f)
    assert code == 0
    doc = json.loads(out)
    assert doc == {"alice": {"tags": [], "configure": ".*", "write": ".*", "read": ".*", "max_connections": 0,
                             "max_queues": 2, "credit_share_percent": 0}}
    assert "SCRAM" not in out



def test_the_loopback_users_name_is_refused_when_the_config_says_so_else_warned(tmp_path: Path) -> None:
    """The broker refuses every login named as its loopback user (docs/security.md): `user add` of that name
    is refused when --config says it is the loopback user; without --config (the default, `guest`,
    assumed) it is added with a warning, and a `user set` or `user passwd` of it warns."""
    path = tmp_path / "u.json"
    config = tmp_path / "broker.toml"
    config.write_text(f'[auth]\nusers_file = "{path}"\nloopback_user = "local"\n')

    def user(*args: str, stdin: str | None = None) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["user", *args], input=stdin)
        return result.exit_code, result.stderr

    code, err = user("add", "local", "--password-stdin", "--config", str(config), stdin="pw\n")
    assert code == 1 and "'local' is the broker's loopback user ([auth] loopback_user in" in err
    assert not path.exists()
    assert user("add", "guest", "--password-stdin", "--config", str(config), stdin="pw\n") == (0, "")
    f = ["--users-file", str(tmp_path / "other.json")]
    warning = "Warning: 'guest' is the broker's loopback user ([auth] loopback_user by default)"
    for args in (["add", "guest"], ["set", "guest", "--max-queues", "2"], ["passwd", "guest"]):
        code, err = user(*args, "--password-stdin" if args[0] != "set" else "--no-tags", *f, stdin="pw\n")
        assert code == 0 and err.startswith(warning) and "give its --config" in err, (args, err)
    assert user("add", "local", "--password-stdin", *f, stdin="pw\n") == (0, "")  # the default is guest
    assert sorted(read_users(path)) == ["guest"] and sorted(read_users(tmp_path / "other.json")) == ["guest", "local"]
