package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// pki is a test CA and certificates it signed, in files.
type pki struct {
	dir, ca string
	key     *ecdsa.PrivateKey
	cert    *x509.Certificate
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "vllm-hi test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	p := &pki{dir: t.TempDir(), key: key, cert: cert}
	p.ca = filepath.Join(p.dir, "ca.pem")
	writePEM(t, p.ca, "CERTIFICATE", der)
	return p
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// issue makes a certificate for 127.0.0.1 usable by servers and clients;
// it returns the certificate and key files.
func (p *pki) issue(t *testing.T, name string) (certFile, keyFile string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.cert, &key.PublicKey, p.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(p.dir, name+".pem"), filepath.Join(p.dir, name+"-key.pem")
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "EC PRIVATE KEY", kb)
	return certFile, keyFile
}

// With certificates, the Host's address (REST, OpenAI, gRPC), the agents'
// gRPC services and the tcp_shm data plane all run over TLS, agents and
// the Host authenticate each other by certificate (mTLS) as well as by
// token, and a migration is as exact as without.
func TestTLSEverywhere(t *testing.T) {
	p := newPKI(t)
	tk := newTokens(t)
	shm := t.TempDir()
	var urls []string
	for i := 0; i < 3; i++ {
		port := freePort(t)
		startVHI(t, "sim", "--port", fmt.Sprint(port), "--served-model-name", "m", "--shm-dir", shm, "--num-gpu-blocks", "4096",
			"--max-model-len", "1024", "--step-fixed", "6ms", "--log-level", "warn", "--engine-token-file", tk.agentFile)
		u := fmt.Sprintf("http://127.0.0.1:%d", port)
		waitHealthy(t, u+"/health")
		urls = append(urls, u)
	}
	hostCert, hostKey := p.issue(t, "host")
	hostAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	hostURL := "https://" + hostAddr
	startVHI(t, append([]string{"host", "--listen", hostAddr, "--heartbeat-interval", "500ms", "--log-level", "warn", "--data-dir", t.TempDir(),
		"--tls-cert-file", hostCert, "--tls-key-file", hostKey, "--tls-client-ca-file", p.ca}, tk.hostArgs()...)...)
	pool := x509.NewCertPool()
	pool.AddCert(p.cert)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 30 * time.Second}
	waitUntil(t, "the Host over TLS", func() bool {
		resp, err := client.Get(hostURL + "/health")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == 200
	})
	for i, typ := range []string{"A", "B"} {
		cert, key := p.issue(t, "agent-"+typ)
		startVHI(t, "agent", "--type", typ, "--id", typ, "--host", hostAddr, "--engine", urls[i], "--log-level", "warn",
			"--token-file", tk.agentFile, "--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", p.ca, "--tls-ca-file", p.ca)
	}
	hc, err := hostapi.New(hostURL, hostapi.Options{AdminToken: tk.admin, TLS: &tls.Config{RootCAs: pool}, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "both agents over mTLS", func() bool {
		v, _ := hc.Instances(context.Background())
		return len(v) == 2 && v[0].TLS && v[1].TLS && v[0].State != "unreachable" && v[1].State != "unreachable"
	})

	reqs := load(32, 400)
	want := loadgen.Run(context.Background(), loadgen.Config{BaseURL: urls[2], Model: "m"}, reqs)
	running := make(chan []loadgen.Stream, 1)
	go func() {
		running <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: hostURL, Model: "m", Client: client}, reqs)
	}()
	time.Sleep(900 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := hc.MigrateAndWait(ctx, hostapi.MigrateRequest{Src: "A", Dst: "B"}, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if st.State != "succeeded" || st.Migrated != 32 {
		t.Fatalf("%+v", st)
	}
	checkExact(t, <-running, want)

	// The CLI verifies the Host with the CA; plain HTTP gets nowhere.
	if out, err := exec.Command(vhiBin, "instances", "--host", hostURL, "--tls-ca-file", p.ca).CombinedOutput(); err != nil || !strings.Contains(string(out), "active") {
		t.Fatalf("vhi instances over TLS: %v\n%s", err, out)
	}
	if resp, err := http.Get("http://" + hostAddr + "/health"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Fatal("the TLS Host answered plain HTTP")
		}
	}
	// An agent without a client certificate is refused by the Host.
	cmd := exec.Command(vhiBin, "agent", "--type", "B", "--id", "nocert", "--host", hostAddr, "--engine", urls[2], "--log-level", "warn",
		"--token-file", tk.agentFile, "--tls-ca-file", p.ca, "--engine-wait", "5s")
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "certificate") {
		t.Fatalf("an agent without a certificate: %v\n%s", err, out)
	}
}
