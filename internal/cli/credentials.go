package cli

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/credentials"
)

// Authentication is on by default. A Host started without token files
// makes its own in its data directory (0600) on first start and keeps
// them; agents, engines and the CLI on the same machine find them there,
// and other machines are given a copy (--token-file,
// VLLM_HI_ENGINE_TOKEN_FILE, --admin-token-file).

// hostTokens resolves the Host's admin and agent tokens.
func hostTokens(dataDir, adminFile, agentFile string, log *zap.Logger) (admin, agent string, err error) {
	ensure := func(name string) (string, error) {
		path := filepath.Join(dataDir, name)
		tok, created, err := credentials.EnsureToken(path)
		if err != nil {
			return "", err
		}
		if created {
			log.Info("created a token: give it to those who need it", zap.String("file", path))
		}
		return tok, nil
	}
	// The operator's files must hold strong tokens (the Host's own are 64
	// hex digits); agents and the CLI only read what the Host accepted.
	read := func(file string) (string, error) {
		tok, err := credentials.ReadToken(file)
		if err == nil {
			err = credentials.CheckStrength(tok, file)
		}
		return tok, err
	}
	if adminFile != "" {
		admin, err = read(adminFile)
	} else {
		admin, err = ensure(credentials.AdminTokenFile)
	}
	if err != nil {
		return "", "", fmt.Errorf("admin token: %w", err)
	}
	switch {
	case agentFile != "":
		agent, err = read(agentFile)
	case adminFile != "":
		agent = admin // the contract's default: the admin token
	default:
		agent, err = ensure(credentials.AgentTokenFile)
	}
	if err != nil {
		return "", "", fmt.Errorf("agent token: %w", err)
	}
	return admin, agent, nil
}

// tlsFlags adds the TLS file flags of a server process.
func tlsFlags(cmd *cobra.Command, f *credentials.TLSFiles) {
	fl := cmd.Flags()
	fl.StringVar(&f.CertFile, "tls-cert-file", "", "serve TLS with this certificate (PEM); also presented as a client certificate")
	fl.StringVar(&f.KeyFile, "tls-key-file", "", "the certificate's private key (PEM)")
	fl.StringVar(&f.ClientCAFile, "tls-client-ca-file", "", "require client certificates signed by this CA (mTLS)")
	fl.StringVar(&f.CAFile, "tls-ca-file", "", "verify the TLS servers this process dials with this CA (default: the system roots)")
}

// engineTokenFile is where an engine finds the agent credential its hooks
// require: VLLM_HI_ENGINE_TOKEN_FILE, else the local Host's agent token.
func engineToken(file string) (tok string, source string, err error) {
	if file == "" {
		file = os.Getenv("VLLM_HI_ENGINE_TOKEN_FILE")
	}
	if file != "" {
		tok, err = credentials.ReadToken(file)
		return tok, file, err
	}
	tok, found, err := credentials.LocalToken(credentials.AgentTokenFile)
	if !found || err != nil {
		return "", "", err
	}
	return tok, filepath.Join(credentials.DefaultDataDir(), credentials.AgentTokenFile), nil
}
