package tcpshm

import (
	"bufio"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// The handshake, in lines of JSON after the magic:
//
//	client → server  {"session": id, "nonce": Nc}
//	server → client  {"nonce": Ns}                     or {"error": …}
//	client → server  {"proof": HMAC(secret, "client", id, Nc, Ns)}
//	server → client  {"proof": HMAC(secret, "server", id, Nc, Ns)} or {"error": …}
//
// Then the client sends frames. Fresh nonces on both sides make every
// proof single-use; the server's proof tells the source it streams the KV
// to the agent the Host prepared, not to whoever holds the address.

// MinSecret is the shortest session secret accepted.
const MinSecret = 16

// maxLine bounds one handshake line (a peer that has not authenticated
// gets no more memory than this).
const maxLine = 4096

type helloMsg struct {
	Session string `json:"session"`
	Nonce   []byte `json:"nonce"`
	// Mode names a Carrier the payloads travel by ("": in the stream).
	Mode string `json:"mode,omitempty"`
}

type challengeMsg struct {
	Nonce []byte `json:"nonce,omitempty"`
	Error string `json:"error,omitempty"`
}

type proofMsg struct {
	Proof []byte `json:"proof,omitempty"`
	Error string `json:"error,omitempty"`
}

// errAuth is a handshake the peer failed.
var errAuth = errors.New("tcp_shm: authentication failed")

func nonce() []byte {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return b
}

func proof(secret []byte, who, session string, cn, sn []byte) []byte {
	m := hmac.New(sha256.New, secret)
	for _, part := range [][]byte{[]byte("vhi-tcpshm-v3"), []byte(who), []byte(session), cn, sn} {
		var n [4]byte
		n[0], n[1], n[2], n[3] = byte(len(part)>>24), byte(len(part)>>16), byte(len(part)>>8), byte(len(part))
		m.Write(n[:])
		m.Write(part)
	}
	return m.Sum(nil)
}

func writeLine(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// readLine reads one bounded JSON line into v.
func readLine(r *bufio.Reader, v any) error {
	line, err := r.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return fmt.Errorf("tcp_shm: handshake line over %d bytes", maxLine)
		}
		return err
	}
	return json.Unmarshal(line, v)
}

// clientHandshake authenticates a fresh connection as the source of
// session and checks the target's proof in return. It returns the reader
// the target's later answers (the acknowledgement) are read through.
func clientHandshake(rw io.ReadWriter, session string, secret []byte, mode string) (*bufio.Reader, error) {
	br := bufio.NewReaderSize(rw, maxLine)
	cn := nonce()
	if _, err := io.WriteString(rw, magic); err != nil {
		return nil, err
	}
	if err := writeLine(rw, helloMsg{Session: session, Nonce: cn, Mode: mode}); err != nil {
		return nil, err
	}
	var ch challengeMsg
	if err := readLine(br, &ch); err != nil {
		return nil, fmt.Errorf("tcp_shm: no challenge from the target: %w", err)
	}
	if ch.Error != "" {
		return nil, fmt.Errorf("tcp_shm: target: %s", ch.Error)
	}
	if len(ch.Nonce) < 16 {
		return nil, fmt.Errorf("%w: the target sent no nonce", errAuth)
	}
	if err := writeLine(rw, proofMsg{Proof: proof(secret, "client", session, cn, ch.Nonce)}); err != nil {
		return nil, err
	}
	var p proofMsg
	if err := readLine(br, &p); err != nil {
		return nil, fmt.Errorf("tcp_shm: no proof from the target: %w", err)
	}
	if p.Error != "" {
		return nil, fmt.Errorf("tcp_shm: target: %s", p.Error)
	}
	if !hmac.Equal(p.Proof, proof(secret, "server", session, cn, ch.Nonce)) {
		return nil, fmt.Errorf("%w: the target does not hold the migration's secret", errAuth)
	}
	return br, nil
}
