package credentials

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
)

// LocalToken reads a token a Host on this machine keeps in the default
// data directory, if there is one. found is false when there is none.
func LocalToken(name string) (tok string, found bool, err error) {
	path := filepath.Join(DefaultDataDir(), name)
	tok, err = ReadToken(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", false, nil
	}
	return tok, err == nil, err
}

// Resolve reads the token file a flag (or its env default) names,
// else the local Host's token of that name; required makes its absence an
// error that says what to pass.
func Resolve(file, name, flag string, required bool) (string, error) {
	if file != "" {
		return ReadToken(file)
	}
	tok, found, err := LocalToken(name)
	switch {
	case err != nil:
		return "", err
	case !found && required:
		return "", fmt.Errorf("no %s: pass %s (the Host keeps it as %s in its data directory, %s by default)",
			name, flag, name, DefaultDataDir())
	}
	return tok, nil
}
