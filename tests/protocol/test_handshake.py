"""The connection handshake (sans IO): both sides prove the secret, it never travels, and a proof is good
for one connection and one direction only."""

from __future__ import annotations

import pytest

from spark_credit_shuffle.errors import ProtocolError
from spark_credit_shuffle.protocol import (
    AuthChallenge,
    AuthResponse,
    CreditBasedPartitionRequestClientHandler,
    PartitionRequest,
    PartitionRequestServerHandler,
    ResultPartitionManager,
    encode_to_bytes,
)
from spark_credit_shuffle.protocol.handshake import ClientHandshake, ServerHandshake

SECRET = b"k" * 32


def _run(client: ClientHandshake, server: ServerHandshake) -> tuple[AuthChallenge, AuthResponse]:
    challenge = server.on_message(client.hello)
    assert challenge is not None
    response = client.on_challenge(challenge)
    assert server.on_message(response) is None
    return challenge, response


def test_both_sides_prove_the_secret_and_it_never_travels():
    client, server = ClientHandshake(SECRET), ServerHandshake(SECRET)
    challenge, response = _run(client, server)
    assert client.done and server.done
    wire = b"".join(encode_to_bytes(m) for m in (client.hello, challenge, response))
    assert SECRET not in wire and SECRET[:8] not in wire


def test_a_wrong_secret_fails_on_whichever_side_checks_it():
    client, server = ClientHandshake(b"guess" * 8), ServerHandshake(SECRET)
    challenge = server.on_message(client.hello)
    with pytest.raises(ProtocolError, match="producer's proof does not verify"):
        client.on_challenge(challenge)  # the client finds out first: it sends nothing more
    # a client that skips the check and answers anyway is refused by the server
    wrong = ClientHandshake(b"guess" * 8, nonce=client.hello.nonce)
    forged = AuthResponse(ServerHandshake(b"guess" * 8, nonce=challenge.nonce).on_message(wrong.hello).proof)
    with pytest.raises(ProtocolError, match="client's proof does not verify"):
        server.on_message(forged)


def test_a_recorded_handshake_replayed_on_a_new_connection_fails():
    client = ClientHandshake(SECRET)
    _, response = _run(client, ServerHandshake(SECRET))
    replayed = ServerHandshake(SECRET)  # a new connection: a new server nonce
    replayed.on_message(client.hello)
    with pytest.raises(ProtocolError, match="wrong secret"):
        replayed.on_message(response)


def test_a_proof_reflected_in_the_other_direction_fails():
    server = ServerHandshake(SECRET)
    challenge = server.on_message(ClientHandshake(SECRET).hello)
    with pytest.raises(ProtocolError, match="wrong secret"):
        server.on_message(AuthResponse(challenge.proof))  # the server's own proof, sent back as the client's
    # a server that mirrors the client's nonce and proof back is not believed either
    client = ClientHandshake(SECRET)
    with pytest.raises(ProtocolError, match="does not verify"):
        client.on_challenge(AuthChallenge(client.hello.nonce, b"\0" * 32))


def test_a_client_sends_nothing_but_its_hello_until_the_server_proved_the_secret():
    woken = []
    client = CreditBasedPartitionRequestClientHandler(secret=SECRET)
    client.listener = lambda: woken.append(1)
    server = PartitionRequestServerHandler(ResultPartitionManager(), secret=SECRET)
    hello = client.next_message()
    client._enqueue(PartitionRequest(1, 0, 2, 7))  # queued while the handshake runs
    assert client.next_message() is None and not client.has_data() and not client.is_authenticated
    server.receive_message(hello)
    client.receive_message(server.next_message())
    assert client.is_authenticated and woken
    response = client.next_message()
    assert isinstance(response, AuthResponse)
    assert client.next_message() == PartitionRequest(1, 0, 2, 7)  # then what waited, in order
    server.receive_message(response)
    assert server.is_authenticated
