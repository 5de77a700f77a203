package credentials

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// TLSFiles are the certificate files of one process.
type TLSFiles struct {
	CertFile string // this process's certificate (PEM), served to peers and presented as a client
	KeyFile  string // its private key
	// ClientCAFile, when set, makes the servers of this process require
	// client certificates signed by it (mTLS).
	ClientCAFile string
	// CAFile verifies the servers this process dials; empty: the system
	// roots.
	CAFile string
}

// Enabled reports whether this process serves TLS.
func (f TLSFiles) Enabled() bool { return f.CertFile != "" }

// Check reports a configuration that cannot work.
func (f TLSFiles) Check() error {
	switch {
	case (f.CertFile == "") != (f.KeyFile == ""):
		return errors.New("--tls-cert-file and --tls-key-file go together")
	case f.ClientCAFile != "" && f.CertFile == "":
		return errors.New("--tls-client-ca-file needs --tls-cert-file (it makes the servers require client certificates)")
	}
	return nil
}

func pool(path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read CA file: %w", err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("CA file %s holds no PEM certificate", path)
	}
	return p, nil
}

// Server is the TLS configuration of this process's servers; nil when it
// serves plain TCP. With a client CA every client must present a
// certificate it signed. protos are the ALPN protocols offered.
func (f TLSFiles) Server(protos ...string) (*tls.Config, error) {
	return f.server(tls.RequireAndVerifyClientCert, protos)
}

// ServerVerifyIfGiven is Server for an address that serves both clients
// without certificates (OpenAI and REST clients, who use tokens) and
// clients that must present one (agents): a certificate that is given
// must verify, and the caller checks who needs one (grpcauth).
func (f TLSFiles) ServerVerifyIfGiven(protos ...string) (*tls.Config, error) {
	return f.server(tls.VerifyClientCertIfGiven, protos)
}

func (f TLSFiles) server(mode tls.ClientAuthType, protos []string) (*tls.Config, error) {
	if err := f.Check(); err != nil || !f.Enabled() {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("load TLS certificate: %w", err)
	}
	c := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12, NextProtos: protos}
	if f.ClientCAFile != "" {
		if c.ClientCAs, err = pool(f.ClientCAFile); err != nil {
			return nil, err
		}
		c.ClientAuth = mode
	}
	return c, nil
}

// Client is the TLS configuration for dialing servers of a TLS
// deployment: it verifies them with CAFile (or the system roots) and
// presents this process's certificate when it has one (for mTLS).
func (f TLSFiles) Client() (*tls.Config, error) {
	if err := f.Check(); err != nil {
		return nil, err
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.CAFile != "" {
		var err error
		if c.RootCAs, err = pool(f.CAFile); err != nil {
			return nil, err
		}
	}
	if f.Enabled() {
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("load TLS certificate: %w", err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}
